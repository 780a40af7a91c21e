//! README.md's "Configuration" table against the server's clap definition (what `--help`
//! prints): every flag has a row, with the same environment variable and default; and no row
//! names a flag the server does not have.

use std::collections::BTreeMap;

use clap::CommandFactory;
use exactscore_server::config::Args;

struct Row {
    env: String,
    default: String,
}

/// `--flag` → row of the table under `## Configuration`.
fn readme_rows() -> BTreeMap<String, Row> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
    let readme = std::fs::read_to_string(path).unwrap();
    let section = readme
        .split("\n## Configuration\n")
        .nth(1)
        .expect("README.md has a `## Configuration` section");
    let section = section.split("\n## ").next().unwrap();
    let mut rows = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `--")) {
        let cells: Vec<String> = line
            .replace("\\|", "/")
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect();
        assert_eq!(cells.len(), 4, "row with {} cells: {line}", cells.len());
        let flag = cells[0]
            .trim_matches('`')
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        let row = Row {
            env: cells[1].trim_matches('`').to_string(),
            default: cells[2].clone(),
        };
        assert!(rows.insert(flag.clone(), row).is_none(), "{flag}: two rows");
    }
    assert!(!rows.is_empty(), "no `| `--flag` ...` rows in the table");
    rows
}

#[test]
fn every_server_flag_is_in_the_readme_configuration_table() {
    let rows = readme_rows();
    let mut command = Args::command();
    // Built as for parsing: then flags such as --healthcheck carry their implicit `false`.
    command.build();
    let mut problems = Vec::new();
    let mut flags = Vec::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        // Hidden flags (`--inject-fault`, for process tests of the failure paths) are not
        // configuration; docs/reliability.md names them.
        if id == "help" || id == "version" || arg.is_hide_set() {
            continue;
        }
        let Some(long) = arg.get_long() else {
            problems.push(format!("{id}: has no --long name"));
            continue;
        };
        let flag = format!("--{long}");
        flags.push(flag.clone());
        let Some(row) = rows.get(&flag) else {
            problems.push(format!("{flag}: no row in README.md's Configuration table"));
            continue;
        };
        let env = arg
            .get_env()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_else(|| "—".into());
        if row.env != env {
            problems.push(format!(
                "{flag}: README says environment {:?}, the server {env:?}",
                row.env
            ));
        }
        // The bundled model's default is an absolute path of the build tree: compare it from
        // the repository root.
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../");
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().replace(root, ""))
            .collect();
        match defaults.as_slice() {
            [] if !row.default.starts_with('—') => problems.push(format!(
                "{flag}: the server has no default, README says {:?} (write `— (...)`)",
                row.default
            )),
            [] => {}
            [d] if !row.default.contains(&format!("`{d}`")) => problems.push(format!(
                "{flag}: default `{d}`, README says {:?}",
                row.default
            )),
            [_] => {}
            many => problems.push(format!("{flag}: several defaults {many:?}")),
        }
    }
    for flag in rows.keys() {
        if !flags.contains(flag) {
            problems.push(format!("{flag}: README row for a flag the server lacks"));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}
