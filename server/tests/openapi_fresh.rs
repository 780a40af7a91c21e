//! `openapi/openapi.json` is generated from the served router; this fails when it is stale.

const REGENERATE: &str =
    "cargo run -q -p exactscore-server -- --print-openapi > openapi/openapi.json";

#[test]
fn committed_openapi_matches_the_router() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../openapi/openapi.json");
    let generated = exactscore_server::http::openapi()
        .to_pretty_json()
        .expect("serializable");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed.trim_end() == generated.trim_end(),
        "openapi/openapi.json is stale; regenerate it from the workspace root with:\n    {REGENERATE}"
    );
}
