//! The server's folders form layers: `ops` imports neither `model` nor `quant`, and no two
//! top-level modules of `src/` import each other in a circle. Read from the source text (every
//! `crate::name` path and `use crate::{...}` group), so a new import that closes a circle fails
//! here, naming it.
//!
//! `cargo test -p exactscore-server --test module_layers -- --nocapture` prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The top-level module a file of `src/` belongs to (`ops/norm.rs` → `ops`, `device.rs` →
/// `device`); `None` for the crate roots and the binaries.
fn module_of(path: &Path) -> Option<String> {
    let rel = path.strip_prefix(src()).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    match first {
        "lib.rs" | "main.rs" | "bin" => None,
        name => Some(name.trim_end_matches(".rs").to_string()),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a file's code names: `crate::x` anywhere outside comments, and each
/// path of a `use crate::{x, y::z}` group.
fn imports(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let text = code.as_str();
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = ident(part.trim());
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

/// Folder-level edges: module → the other top-level modules its files import.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(f)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(from) = module_of(file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let targets = edges.entry(from.clone()).or_default();
        for to in imports(&text) {
            if to != from && modules.contains(&to) {
                targets.insert(to);
            }
        }
    }
    edges
}

/// A circle through `start`, if any: the path back to it.
fn circle_through(edges: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![start.to_string()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let last = path.last().unwrap();
        for next in edges.get(last).into_iter().flatten() {
            if next == start {
                let mut circle = path.clone();
                circle.push(start.to_string());
                return Some(circle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push(longer);
            }
        }
    }
    None
}

#[test]
fn ops_imports_neither_model_nor_quant() {
    let edges = graph();
    let ops = &edges["ops"];
    for layer in ["model", "quant", "engine", "http"] {
        assert!(!ops.contains(layer), "ops imports {layer}: {ops:?}");
    }
}

#[test]
fn no_two_top_level_modules_import_each_other_in_a_circle() {
    let edges = graph();
    for (from, to) in &edges {
        println!(
            "{from:>12} -> {}",
            to.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let circles: Vec<Vec<String>> = edges
        .keys()
        .filter_map(|m| circle_through(&edges, m))
        .collect();
    assert!(
        circles.is_empty(),
        "import circles between folders: {circles:?}"
    );
}

#[test]
fn the_reader_finds_imports_in_every_form() {
    let text = "use crate::ops::{a, b};\nuse crate::{model::x, quant};\nlet y = crate::device::bind(d);\n/// [`crate::engine`] is a comment";
    let found: Vec<String> = imports(text).into_iter().collect();
    assert_eq!(found, ["device", "model", "ops", "quant"]);
}
