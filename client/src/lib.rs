//! ExactScore client: a typed async client of the ExactScore server ([`http`]), window arithmetic
//! ([`windows`]), datasets ([`dataset`]), tokenization ([`tokenize`]), the perplexity runner
//! ([`runner::run_ppl`], which also runs `exactscore kld`), KL-divergence statistics ([`kld`]),
//! statistics by position in the window ([`positions`]),
//! one endpoint per address of a server name ([`resolve`]), reports ([`report`]), the
//! per-layer comparison of `exactscore diff` ([`diff`]), plots ([`plot`]) and the publishable
//! report directory of `exactscore report` ([`report_dir`], [`record`], [`card`]).

pub mod card;
pub mod compare;
pub mod dataset;
pub mod diff;
pub mod fingerprint;
pub mod http;
pub mod kld;
pub mod llamacpp;
pub mod plot;
pub mod positions;
pub mod progress;
pub mod record;
pub mod reference;
pub mod report;
pub mod report_dir;
pub mod resolve;
pub mod runner;
pub mod term;
pub mod tokenize;
pub mod windows;

pub use diff::{run_diff, DiffConfig, DiffReport};
pub use http::{Client, ClientConfig, ClientError, RetryPolicy};
pub use kld::{KldStats, KldWindow};
pub use report::{Report, Stats, WindowResult};
pub use resolve::{Endpoint, Resolve, StaticResolver, SystemResolver};
pub use runner::{run_ppl, PplConfig, PplError, Progress, ProgressHook, Task};
pub use windows::{Method, Window, WindowParams};
