//! Token sampling, in llama.cpp's chain order: penalties -> top-k -> top-p -> min-p -> temperature
//! -> draw. Temperature <= 0 is greedy (the first maximum wins).

/// Sampling settings; defaults are llama.cpp's.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables. Logits of recent tokens: <= 0 multiplied, > 0 divided by this.
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of every token seen in the window.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the window.
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at (0: none).
    pub penalty_last_n: usize,
    /// Seed of the random draw; the same seed, prompt and settings give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0xFFFF_FFFF,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects settings outside their meaningful ranges.
    pub fn validate(&self) -> Result<(), String> {
        let finite = [
            self.temperature,
            self.top_p,
            self.min_p,
            self.repeat_penalty,
            self.presence_penalty,
            self.frequency_penalty,
        ];
        if finite.iter().any(|v| !v.is_finite()) {
            return Err("sampling parameters must be finite numbers".into());
        }
        if self.temperature < 0.0 {
            return Err(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) || self.top_p == 0.0 {
            return Err(format!("top-p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p {} must be in [0, 1]", self.min_p));
        }
        if self.repeat_penalty <= 0.0 {
            return Err(format!(
                "repeat penalty {} must be > 0",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

/// Mersenne Twister MT19937 (Matsumoto & Nishimura 1998), the generator llama.cpp seeds with `seed`.
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            state[i] = 1_812_433_253u32
                .wrapping_mul(state[i - 1] ^ (state[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        Self { state, index: 624 }
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            for i in 0..624 {
                let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
                let mut v = self.state[(i + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    v ^= 0x9908_b0df;
                }
                self.state[i] = v;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// Uniform in [0, 1) from two draws, as libstdc++'s `uniform_real_distribution<double>`.
    pub fn next_f64(&mut self) -> f64 {
        let lo = self.next_u32() as f64;
        let hi = self.next_u32() as f64;
        let r = (lo + hi * 4_294_967_296.0) / 18_446_744_073_709_551_616.0;
        r.min(1.0 - f64::EPSILON / 2.0)
    }
}

/// A sampler with its random state and the recent-token window the penalties read.
pub struct Sampler {
    pub params: SamplingParams,
    rng: Mt19937,
    history: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Mt19937::new(params.seed as u32);
        Self {
            params,
            rng,
            history: Vec::new(),
        }
    }

    /// Records a token (prompt or generated) for the penalties.
    pub fn accept(&mut self, id: u32) {
        self.history.push(id);
    }

    /// Picks the next token from a row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 && !self.penalties_apply() {
            // Greedy with nothing to penalise: the first maximum, without a candidate list
            // (the same token as the chain below picks).
            return first_argmax(logits) as u32;
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        self.apply_penalties(&mut cand);
        let p = p.clone();
        if p.temperature <= 0.0 {
            return argmax(&cand);
        }
        // top-k: keep the k largest, sorted descending.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        // top-p on the softmax of the survivors.
        if p.top_p < 1.0 {
            let probs = softmax(&cand);
            let mut cum = 0f32;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        // min-p: logits >= max + ln(p).
        if p.min_p > 0.0 {
            let thr = cand[0].1 + p.min_p.ln();
            let keep = cand.iter().take_while(|c| c.1 >= thr).count().max(1);
            cand.truncate(keep);
        }
        for c in cand.iter_mut() {
            c.1 /= p.temperature;
        }
        let max = cand[0].1;
        let weights: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f64 = weights.iter().map(|&w| w as f64).sum();
        let target = self.rng.next_f64() * sum;
        let mut acc = 0f64;
        for (c, &w) in cand.iter().zip(&weights) {
            acc += w as f64;
            if acc >= target {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }

    /// Whether the penalties change any logit now.
    fn penalties_apply(&self) -> bool {
        let p = &self.params;
        let active =
            p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        active && p.penalty_last_n != 0 && !self.history.is_empty()
    }

    fn apply_penalties(&self, cand: &mut [(u32, f32)]) {
        let p = &self.params;
        if !self.penalties_apply() {
            return;
        }
        let start = self.history.len().saturating_sub(p.penalty_last_n);
        let mut counts: std::collections::HashMap<u32, u32> = Default::default();
        for &t in &self.history[start..] {
            *counts.entry(t).or_default() += 1;
        }
        for (&tok, &n) in &counts {
            if let Some(c) = cand.get_mut(tok as usize) {
                if c.1 <= 0.0 {
                    c.1 *= p.repeat_penalty;
                } else {
                    c.1 /= p.repeat_penalty;
                }
                c.1 -= n as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
    }
}

fn argmax(cand: &[(u32, f32)]) -> u32 {
    let mut best = 0;
    for (i, c) in cand.iter().enumerate() {
        if c.1 > cand[best].1 {
            best = i;
        }
    }
    cand[best].0
}

/// The index of the first maximum of `x` (NaNs never win; 0 when every value is NaN or `x` is
/// empty), in two passes the compiler vectorises: the maximum, in 16 lanes; then the first
/// 16-value chunk holding it (a compare per chunk), and its first index there. The engine
/// draws a greedy token this way from every sequence's logits at every step.
fn first_argmax(x: &[f32]) -> usize {
    const L: usize = 16;
    let chunks = x.chunks_exact(L);
    let rest = chunks.remainder();
    let mut lanes = [f32::NEG_INFINITY; L];
    for c in chunks {
        for j in 0..L {
            // `f32::max` returns the other operand when one is NaN.
            lanes[j] = lanes[j].max(c[j]);
        }
    }
    let best = lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    x.chunks(L)
        .position(|c| c.iter().fold(false, |hit, &v| hit | (v == best)))
        .and_then(|ci| {
            let at = x[ci * L..].iter().position(|&v| v == best)?;
            Some(ci * L + at)
        })
        .unwrap_or(0)
}

fn softmax(cand: &[(u32, f32)]) -> Vec<f32> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let s: f32 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// log-softmax of a full row of logits, returning the `k` most likely `(token, logprob)`,
/// most likely first (ties: lower id first).
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    idx.into_iter()
        .map(|i| (i, (logits[i as usize] as f64 - lse) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition: the first index whose value is the largest non-NaN value.
    fn first_argmax_ref(x: &[f32]) -> usize {
        let max = x.iter().copied().filter(|v| !v.is_nan()).reduce(f32::max);
        max.and_then(|m| x.iter().position(|&v| v == m))
            .unwrap_or(0)
    }

    #[test]
    fn first_argmax_agrees_with_the_plain_definition() {
        // Fresh random inputs each run: lengths around the 16-lane chunks, few distinct values
        // (ties across lanes and chunks), NaNs and infinities mixed in.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u32 | 1);
        let mut r = Mt19937::new(seed);
        for case in 0..2000 {
            let n = (r.next_u32() % 100) as usize;
            let x: Vec<f32> = (0..n)
                .map(|_| match r.next_u32() % 10 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 if case % 7 == 0 => f32::INFINITY,
                    _ => (r.next_u32() % 5) as f32,
                })
                .collect();
            assert_eq!(first_argmax(&x), first_argmax_ref(&x), "seed {seed}, {x:?}");
        }
        assert_eq!(first_argmax(&[f32::NEG_INFINITY; 40]), 0);
        assert_eq!(first_argmax(&[f32::NAN; 40]), 0);
        assert_eq!(first_argmax(&[]), 0);
    }

    #[test]
    fn mt19937_matches_the_standard_sequence() {
        // The C++ standard requires the 10000th output of a default-seeded (5489) mt19937 to be 4123659995.
        let mut r = Mt19937::new(5489);
        let mut last = 0;
        for _ in 0..10000 {
            last = r.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, 2.0, -1.0]), 1);
        // The fast path (no penalties) and the full chain (a penalty on a token that is not the
        // winner) agree with the first maximum on fresh random rows with ties.
        let seed: u64 = rand::random();
        let mut rng = Mt19937::new(seed as u32);
        for _ in 0..200 {
            let row: Vec<f32> = (0..500)
                .map(|_| (rng.next_u32() % 64) as f32 / 8.0)
                .collect();
            let first_max = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            let mut fast = Sampler::new(SamplingParams::greedy());
            assert_eq!(fast.sample(&row) as usize, first_max, "seed {seed}");
            let mut chain = Sampler::new(SamplingParams {
                presence_penalty: 0.5,
                ..SamplingParams::greedy()
            });
            let other = (first_max + 1) % row.len();
            chain.accept(other as u32);
            let want = if row[other] - 0.5 > row[first_max] {
                other
            } else {
                first_max
            };
            assert_eq!(chain.sample(&row) as usize, want, "seed {seed}");
        }
    }

    #[test]
    fn filters_restrict_the_draw() {
        let logits = [5.0, 4.9, 0.0, -3.0, 1.0];
        // top-k 2: only ids 0 and 1 can come out, whatever the seed.
        for seed in 0..50 {
            let mut s = Sampler::new(SamplingParams {
                top_k: 2,
                seed,
                min_p: 0.0,
                top_p: 1.0,
                ..Default::default()
            });
            assert!(s.sample(&logits) <= 1);
        }
        // min-p 0.5: ids whose prob < 0.5 * p_max are out (only 0 and 1 remain).
        for seed in 0..50 {
            let mut s = Sampler::new(SamplingParams {
                top_k: 0,
                seed,
                min_p: 0.5,
                top_p: 1.0,
                ..Default::default()
            });
            assert!(s.sample(&logits) <= 1);
        }
        // top-p 0.5: id 0 alone covers 52% of the mass.
        for seed in 0..50 {
            let mut s = Sampler::new(SamplingParams {
                top_k: 0,
                seed,
                min_p: 0.0,
                top_p: 0.5,
                ..Default::default()
            });
            assert_eq!(s.sample(&logits), 0);
        }
    }

    #[test]
    fn same_seed_same_draws_and_penalties_apply() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 31 % 17) as f32) * 0.1).collect();
        let params = SamplingParams {
            seed: 42,
            top_k: 0,
            min_p: 0.0,
            top_p: 1.0,
            temperature: 1.5,
            ..Default::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        assert_ne!(
            draw(&params),
            draw(&SamplingParams {
                seed: 43,
                ..params.clone()
            })
        );
        // A huge presence penalty on the greedy winner moves greedy to the runner-up.
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 100.0,
            ..SamplingParams::greedy()
        });
        let best = s.sample(&logits);
        s.accept(best);
        assert_ne!(s.sample(&logits), best);
    }

    #[test]
    fn top_logprobs_are_normalised_and_sorted() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let top = top_logprobs(&logits, 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let total: f64 = logits
            .iter()
            .map(|&l| (l as f64 + top[0].1 as f64 - 3.0).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
