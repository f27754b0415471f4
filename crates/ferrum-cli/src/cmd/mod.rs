pub mod bench;
pub mod chat;
pub mod generate;
pub mod info;
pub mod machine;
pub mod perplexity;
pub mod profile;
pub mod serve;
