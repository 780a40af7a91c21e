//! A tiny ANSI colour helper: colour only when asked or when stdout is a terminal.

use std::io::IsTerminal;

/// When to colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ColorChoice {
    Auto,
    Always,
    Never,
}

impl ColorChoice {
    /// Whether to emit ANSI codes on stdout (`auto`: only on a terminal, and not with `NO_COLOR`
    /// set, which the CLI passes in as `no_color`).
    pub fn enabled(self, no_color: bool) -> bool {
        match self {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => !no_color && std::io::stdout().is_terminal(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Color {
    Red,
    Yellow,
    Green,
    Dim,
}

/// `s` wrapped in the colour's escape codes when `on`.
pub fn paint(s: &str, color: Color, on: bool) -> String {
    if !on {
        return s.to_string();
    }
    let code = match color {
        Color::Red => "1;31",
        Color::Yellow => "33",
        Color::Green => "32",
        Color::Dim => "2",
    };
    format!("\x1b[{code}m{s}\x1b[0m")
}

/// Colour of a token by its log-probability: red below ln(1/100) (very surprising), yellow below
/// ln(1/10), green otherwise.
pub fn surprise_color(logprob: f32) -> Color {
    if logprob < -(100f32.ln()) {
        Color::Red
    } else if logprob < -(10f32.ln()) {
        Color::Yellow
    } else {
        Color::Green
    }
}

/// A token string made printable on one line (`\n`, `\t`, control characters escaped).
pub fn escape_token(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '\n' => vec!['\\', 'n'],
            '\r' => vec!['\\', 'r'],
            '\t' => vec!['\\', 't'],
            c if c.is_control() => format!("\\u{{{:x}}}", c as u32).chars().collect(),
            c => vec![c],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_codes_when_off() {
        assert_eq!(paint("x", Color::Red, false), "x");
        assert_eq!(paint("x", Color::Red, true), "\x1b[1;31mx\x1b[0m");
        assert_eq!(escape_token("a\nb\u{1}"), "a\\nb\\u{1}");
        assert_eq!(surprise_color(-0.1), Color::Green);
        assert_eq!(surprise_color(-3.0), Color::Yellow);
        assert_eq!(surprise_color(-6.0), Color::Red);
    }
}
