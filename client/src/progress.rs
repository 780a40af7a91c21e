//! Where a run stands, shown to a person: a bar on a terminal, and one plain line every
//! [`ProgressConfig::every`] when stderr is not a terminal (a log file, `nohup`, CI), so that a
//! long run is never silent until its end.

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use crate::runner::{Progress, ProgressHook, Task};

/// How progress is shown.
#[derive(Debug, Clone)]
pub struct ProgressConfig {
    /// Show progress at all (the bar, or the plain lines).
    pub enabled: bool,
    /// Off a terminal: the time between two plain lines (zero: one line per finished window).
    pub every: Duration,
    /// Force the plain lines even on a terminal (tests, and `--progress-lines`).
    pub lines: bool,
}

impl Default for ProgressConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            every: Duration::from_secs(10),
            lines: false,
        }
    }
}

/// Running sums of a run: what the running statistic is computed from.
#[derive(Debug, Clone, Copy, Default)]
pub struct Running {
    /// Σ NLL and the tokens it is over, resumed windows included.
    pub sum_nll: f64,
    pub tokens: usize,
    /// Σ per-token KLD (`kld` runs).
    pub sum_kld: f64,
    /// Tokens scored in this run (for tokens/s).
    pub new_tokens: usize,
    pub done: usize,
}

impl Running {
    fn perplexity(&self) -> f64 {
        (self.sum_nll / self.tokens as f64).exp()
    }

    fn mean_kld(&self) -> f64 {
        self.sum_kld / self.tokens as f64
    }
}

/// Shows a run's progress: bar or plain lines, and the caller's hook.
pub struct Reporter {
    bar: indicatif::ProgressBar,
    lines: bool,
    every: Duration,
    last_line: Option<Instant>,
    started: Instant,
    total: usize,
    resumed: usize,
    task: Task,
    hook: Option<ProgressHook>,
}

impl Reporter {
    pub fn new(
        cfg: &ProgressConfig,
        task: Task,
        total: usize,
        resumed: usize,
        hook: Option<ProgressHook>,
    ) -> Self {
        let lines = cfg.enabled && (cfg.lines || !std::io::stderr().is_terminal());
        let bar = if cfg.enabled && !lines {
            bar(total, resumed)
        } else {
            indicatif::ProgressBar::hidden()
        };
        Self {
            bar,
            lines,
            every: cfg.every,
            last_line: None,
            started: Instant::now(),
            total,
            resumed,
            task,
            hook,
        }
    }

    /// After each finished window (and once at the start).
    pub fn update(&mut self, r: &Running) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let p = Progress {
            done: r.done,
            total: self.total,
            tokens_per_s: r.new_tokens as f64 / secs,
            perplexity: r.perplexity(),
        };
        let stat = (r.tokens > 0).then(|| self.statistic(r));
        if let Some(stat) = &stat {
            self.bar.set_position(r.done as u64);
            self.bar
                .set_message(format!("{:.0} tok/s, {stat}", p.tokens_per_s));
        }
        if self.lines && r.done > self.resumed && self.line_due() {
            eprintln!("{}", self.line(&p, stat.as_deref(), secs));
        }
        if let Some(hook) = &self.hook {
            (hook.0)(p);
        }
    }

    fn statistic(&self, r: &Running) -> String {
        match self.task {
            Task::Ppl => format!("ppl {:.4}", r.perplexity()),
            Task::Kld => format!("kld {:.6}, ppl {:.4}", r.mean_kld(), r.perplexity()),
        }
    }

    fn line_due(&mut self) -> bool {
        let due = self.last_line.is_none_or(|t| t.elapsed() >= self.every);
        if due {
            self.last_line = Some(Instant::now());
        }
        due
    }

    /// `progress: 12/40 windows, 3456 tok/s, ETA 1m 23s, ppl 12.3456`.
    fn line(&self, p: &Progress, stat: Option<&str>, secs: f64) -> String {
        let new = p.done.saturating_sub(self.resumed);
        let left = self.total.saturating_sub(p.done);
        let eta = (new > 0).then(|| secs / new as f64 * left as f64);
        format!(
            "progress: {}/{} windows, {:.0} tok/s, ETA {}{}",
            p.done,
            self.total,
            p.tokens_per_s,
            eta.map_or_else(|| "?".into(), duration),
            stat.map(|s| format!(", {s}")).unwrap_or_default()
        )
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `1h 02m`, `3m 05s`, `42s`.
pub fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m {s:02}s"),
        (h, m, _) => format!("{h}h {m:02}m"),
    }
}

fn bar(total: usize, done: usize) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} windows [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb.set_position(done as u64);
    pb.reset_eta();
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_a_person_writes_them() {
        assert_eq!(duration(42.4), "42s");
        assert_eq!(duration(185.0), "3m 05s");
        assert_eq!(duration(3725.0), "1h 02m");
        assert_eq!(duration(-3.0), "0s");
    }

    #[test]
    fn a_line_names_windows_rate_eta_and_the_running_kld() {
        let cfg = ProgressConfig {
            enabled: true,
            every: Duration::ZERO,
            lines: true,
        };
        let r = Reporter::new(&cfg, Task::Kld, 40, 0, None);
        let run = Running {
            sum_nll: 20.0,
            tokens: 10,
            sum_kld: 0.5,
            new_tokens: 10,
            done: 10,
        };
        let p = Progress {
            done: 10,
            total: 40,
            tokens_per_s: 5.0,
            perplexity: run.perplexity(),
        };
        let line = r.line(&p, Some(&r.statistic(&run)), 20.0);
        assert_eq!(
            line,
            "progress: 10/40 windows, 5 tok/s, ETA 1m 00s, kld 0.050000, ppl 7.3891"
        );
    }
}
