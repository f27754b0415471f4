//! Code-point classification as llama.cpp's pre-tokenizers see it (`src/unicode.cpp`).
//!
//! llama.cpp stores one flag word per code point: exactly one category bit (from the Unicode
//! general category) plus a separate White_Space bit. Unassigned code points (`Cn`) carry the
//! *non-zero* `UNDEFINED` bit, so "has any flag" means "is a code point inside the fragment",
//! never "is assigned"; only the out-of-range sentinel has no flags at all. We compute the same
//! word from the `unicode-general-category` tables and Rust's `char::is_whitespace` (which is
//! the Unicode White_Space property). On top of llama.cpp's bits, letters carry a case bit
//! (`UPPER` for `Lu`/`Lt`, `LOWER` for `Ll`, none for `Lm`/`Lo`) for the o200k pattern's
//! `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]` / `[\p{Ll}\p{Lm}\p{Lo}\p{M}]` classes.
//!
//! Unicode version: llama.cpp's tables (`unicode-data.cpp`) are Unicode 15.1 — measured against
//! llama.cpp: letters added in 15.1 (CJK Extension I) split as letters, letters added in 16.0
//! as unassigned. `unicode-general-category` 0.6 is Unicode 15.0, so the 627 code points that
//! 15.1 added are patched in here.

use unicode_general_category::{get_general_category, GeneralCategory as Gc};

/// Category and whitespace flags of one code point (`unicode_cpt_flags` in llama.cpp).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags(u16);

impl Flags {
    pub const UNDEFINED: u16 = 0x0001;
    pub const NUMBER: u16 = 0x0002;
    pub const LETTER: u16 = 0x0004;
    pub const SEPARATOR: u16 = 0x0008;
    pub const MARK: u16 = 0x0010;
    pub const PUNCTUATION: u16 = 0x0020;
    pub const SYMBOL: u16 = 0x0040;
    pub const CONTROL: u16 = 0x0080;
    pub const WHITESPACE: u16 = 0x0100;
    /// Case of a letter: `Lu` or `Lt` (never set together with `LOWER`).
    pub const UPPER: u16 = 0x0200;
    /// Case of a letter: `Ll`.
    pub const LOWER: u16 = 0x0400;

    /// The sentinel for a position outside the fragment being split: no flag at all.
    pub const NONE: Flags = Flags(0);

    /// Flags of `c`.
    pub fn of(c: char) -> Flags {
        let cat = match general_category_15_1(c) {
            Gc::UppercaseLetter | Gc::TitlecaseLetter => Self::LETTER | Self::UPPER,
            Gc::LowercaseLetter => Self::LETTER | Self::LOWER,
            Gc::ModifierLetter | Gc::OtherLetter => Self::LETTER,
            Gc::DecimalNumber | Gc::LetterNumber | Gc::OtherNumber => Self::NUMBER,
            Gc::NonspacingMark | Gc::SpacingMark | Gc::EnclosingMark => Self::MARK,
            Gc::ConnectorPunctuation
            | Gc::DashPunctuation
            | Gc::OpenPunctuation
            | Gc::ClosePunctuation
            | Gc::InitialPunctuation
            | Gc::FinalPunctuation
            | Gc::OtherPunctuation => Self::PUNCTUATION,
            Gc::MathSymbol | Gc::CurrencySymbol | Gc::ModifierSymbol | Gc::OtherSymbol => {
                Self::SYMBOL
            }
            Gc::SpaceSeparator | Gc::LineSeparator | Gc::ParagraphSeparator => Self::SEPARATOR,
            Gc::Control | Gc::Format | Gc::PrivateUse | Gc::Surrogate => Self::CONTROL,
            // Unassigned, and anything a future table version might add
            _ => Self::UNDEFINED,
        };
        let ws = if c.is_whitespace() {
            Self::WHITESPACE
        } else {
            0
        };
        Flags(cat | ws)
    }

    /// Any flag set (false only for the out-of-range sentinel).
    #[inline]
    pub fn any(self) -> bool {
        self.0 != 0
    }
    #[inline]
    pub fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    #[inline]
    pub fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    #[inline]
    pub fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
    #[inline]
    pub fn is_punctuation(self) -> bool {
        self.0 & Self::PUNCTUATION != 0
    }
    /// `\p{M}`.
    #[inline]
    pub fn is_mark(self) -> bool {
        self.0 & Self::MARK != 0
    }
    /// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`: a letter that is not lowercase, or a mark.
    #[inline]
    pub fn is_upper_or_uncased(self) -> bool {
        (self.is_letter() && self.0 & Self::LOWER == 0) || self.is_mark()
    }
    /// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`: a letter that is not upper- or titlecase, or a mark.
    #[inline]
    pub fn is_lower_or_uncased(self) -> bool {
        (self.is_letter() && self.0 & Self::UPPER == 0) || self.is_mark()
    }
}

/// The general category under Unicode 15.1: the 15.0 table plus 15.1's additions
/// (U+2FFC..=U+2FFF and U+31EF ideographic description characters, So; CJK Unified Ideographs
/// Extension I U+2EBF0..=U+2EE5D, Lo).
fn general_category_15_1(c: char) -> Gc {
    match c as u32 {
        0x2FFC..=0x2FFF | 0x31EF => Gc::OtherSymbol,
        0x2EBF0..=0x2EE5D => Gc::OtherLetter,
        _ => get_general_category(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories() {
        assert!(Flags::of('a').is_letter());
        assert!(Flags::of('東').is_letter());
        assert!(Flags::of('7').is_number());
        assert!(Flags::of('½').is_number());
        assert!(Flags::of(' ').is_whitespace());
        assert!(Flags::of('\u{3000}').is_whitespace());
        assert!(Flags::of('\u{85}').is_whitespace());
        assert!(!Flags::of('\u{200B}').is_whitespace()); // ZWSP is Cf, not White_Space
        assert!(Flags::of('!').is_punctuation());
        // Unassigned code points still have a flag (UNDEFINED), as in llama.cpp.
        assert!(Flags::of('\u{0378}').any());
        assert!(!Flags::NONE.any());
        // Unicode 15.1 additions are known, 16.0 ones are not (as in llama.cpp)
        assert!(Flags::of('\u{2EBF0}').is_letter());
        assert!(Flags::of('\u{31350}').is_letter()); // CJK Ext H, 15.0
        assert!(!Flags::of('\u{A7DA}').is_letter());
        assert_eq!(Flags::of('\u{A7DA}'), Flags(Flags::UNDEFINED));
    }

    #[test]
    fn letter_case_classes() {
        // (char, in [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], in [\p{Ll}\p{Lm}\p{Lo}\p{M}])
        let cases = [
            ('A', true, false),
            ('É', true, false),
            ('Σ', true, false),
            ('ǅ', true, false), // Lt
            ('a', false, true),
            ('é', false, true),
            ('ſ', false, true),
            ('ʰ', true, true),        // Lm
            ('東', true, true),       // Lo
            ('\u{0301}', true, true), // Mn
            ('\u{0903}', true, true), // Mc
            ('\u{20DD}', true, true), // Me
            ('1', false, false),
            ('_', false, false),
            (' ', false, false),
        ];
        for (c, up, low) in cases {
            let f = Flags::of(c);
            assert_eq!(f.is_upper_or_uncased(), up, "{c:?}");
            assert_eq!(f.is_lower_or_uncased(), low, "{c:?}");
        }
        assert!(Flags::of('\u{0301}').is_mark() && !Flags::of('\u{0301}').is_letter());
        assert!(!Flags::NONE.is_upper_or_uncased() && !Flags::NONE.is_lower_or_uncased());
    }
}
