pub mod chat;
pub mod generate;
pub mod info;
pub mod perplexity;
pub mod bench;
pub mod machine;
