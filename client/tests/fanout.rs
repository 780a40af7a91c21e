//! One `--server` name whose A records are several servers (a Kubernetes headless Service):
//! `run_ppl` spreads the windows over every address, keeps the URL's port and `Host` header,
//! and computes the same result as against one server. Real fake servers on 127.0.0.1 and
//! 127.0.0.2 (same port), an injected resolver for the made-up name.

mod common;

use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use common::{fake_app, Fake};
use exactscore_client::dataset::DatasetSpec;
use exactscore_client::resolve::{endpoints, Endpoint};
use exactscore_client::{run_ppl, Method, PplConfig, StaticResolver};

const NAME: &str = "exactscore-headless.ns.svc.test";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A fake server on `listener` that records the `Host` header of every request.
fn serve(listener: tokio::net::TcpListener, fake: Arc<Fake>, hosts: Arc<Mutex<Vec<String>>>) {
    let app = fake_app(fake).layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let hosts = hosts.clone();
            async move {
                let host = req
                    .headers()
                    .get("host")
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                hosts.lock().unwrap().push(host);
                next.run(req).await
            }
        },
    ));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
}

struct Pair {
    port: u16,
    fakes: [Arc<Fake>; 2],
    hosts: Arc<Mutex<Vec<String>>>,
}

/// Two fake servers on one port, at 127.0.0.1 and 127.0.0.2.
async fn pair() -> Pair {
    for _ in 0..50 {
        let a = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = a.local_addr().unwrap().port();
        let Ok(b) = tokio::net::TcpListener::bind(("127.0.0.2", port)).await else {
            continue;
        };
        let hosts = Arc::new(Mutex::new(Vec::new()));
        let fakes = [Fake::new(Some("k")), Fake::new(Some("k"))];
        serve(a, fakes[0].clone(), hosts.clone());
        serve(b, fakes[1].clone(), hosts.clone());
        return Pair { port, fakes, hosts };
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

fn dataset(dir: &std::path::Path) -> DatasetSpec {
    let words = [
        "scores",
        "every",
        "token",
        "of",
        "the",
        "quantized",
        "model",
    ];
    let text: String = (0..1500)
        .map(|i| words[(i * 5 + i / 7) % words.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let p = dir.join("data.txt");
    std::fs::write(&p, text).unwrap();
    DatasetSpec::Txt(p)
}

fn config(servers: Vec<String>, ds: DatasetSpec) -> PplConfig {
    let mut c = PplConfig::new(servers, ds);
    c.api_key = Some("k".into());
    c.method = Method::Exl3;
    c.ctx = 64;
    c.stride = 32;
    c.concurrency = 4;
    c.timeout = Duration::from_secs(30);
    c
}

#[tokio::test]
async fn one_name_with_two_addresses_spreads_the_run_over_both() {
    let dir = tempfile::tempdir().unwrap();
    let Pair { port, fakes, hosts } = pair().await;
    let url = format!("http://{NAME}:{port}");
    let mut cfg = config(vec![url.clone()], dataset(dir.path()));
    cfg.resolver = Arc::new(StaticResolver::new([(
        NAME,
        vec![ip("127.0.0.1"), ip("127.0.0.2")],
    )]));
    let r = run_ppl(cfg).await.unwrap();

    let calls = fakes
        .each_ref()
        .map(|f| f.score_calls.load(Ordering::SeqCst));
    assert!(
        calls.iter().all(|&n| n > 0),
        "both addresses scored: {calls:?}"
    );
    assert_eq!(calls.iter().sum::<usize>(), r.stats.windows);
    assert_eq!(
        r.servers,
        [
            format!("{url} via 127.0.0.1:{port}"),
            format!("{url} via 127.0.0.2:{port}")
        ]
    );
    let hosts = hosts.lock().unwrap().clone();
    let expected = format!("{NAME}:{port}");
    assert!(
        !hosts.is_empty() && hosts.iter().all(|h| *h == expected),
        "Host headers: {hosts:?}"
    );

    // The same evaluation against one address, by IP: the same numbers.
    let one = run_ppl(config(
        vec![format!("http://127.0.0.2:{port}")],
        dataset(dir.path()),
    ))
    .await
    .unwrap();
    assert_eq!(one.servers, [format!("http://127.0.0.2:{port}")]);
    assert_eq!(
        (one.stats.windows, one.stats.tokens_scored),
        (r.stats.windows, r.stats.tokens_scored)
    );
    assert_eq!(one.stats.total_nll, r.stats.total_nll);
    assert_eq!(one.per_window, r.per_window);
}

#[tokio::test]
async fn localhost_through_the_system_resolver_is_one_server() {
    let dir = tempfile::tempdir().unwrap();
    let Pair { port, fakes, .. } = pair().await;
    let r = run_ppl(config(
        vec![format!("http://localhost:{port}")],
        dataset(dir.path()),
    ))
    .await
    .unwrap();
    assert_eq!(
        r.servers,
        [format!("http://localhost:{port} via 127.0.0.1:{port}")]
    );
    assert_eq!(fakes[0].score_calls.load(Ordering::SeqCst), r.stats.windows);
    assert_eq!(fakes[1].score_calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn endpoints_prefer_ipv4_skip_ip_literals_and_drop_duplicates() {
    let resolver = StaticResolver::new([
        (
            "dual.test",
            vec![ip("::1"), ip("127.0.0.1"), ip("127.0.0.9")],
        ),
        ("v6only.test", vec![ip("::1")]),
    ]);
    let servers = [
        "http://dual.test:9/",
        "http://DUAL.test:9",
        "https://v6only.test",
        "http://127.0.0.3:9",
        "http://[::1]:9",
        "http://127.0.0.3:9/",
    ]
    .map(String::from);
    let got = endpoints(&servers, &resolver).await.unwrap();
    let e = |url: &str, addr: Option<&str>| Endpoint {
        url: url.into(),
        addr: addr.map(|a| a.parse().unwrap()),
    };
    assert_eq!(
        got,
        [
            e("http://dual.test:9", Some("127.0.0.1:9")),
            e("http://dual.test:9", Some("127.0.0.9:9")),
            e("https://v6only.test", Some("[::1]:443")),
            e("http://127.0.0.3:9", None),
            e("http://[::1]:9", None),
        ]
    );
    // "http://DUAL.test:9" and the trailing slashes are the same URLs once normalized.
}

#[tokio::test]
async fn a_name_that_does_not_resolve_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(vec!["http://nowhere.test:1".into()], dataset(dir.path()));
    cfg.resolver = Arc::new(StaticResolver::default());
    let err = run_ppl(cfg).await.unwrap_err().to_string();
    assert!(err.contains("cannot resolve nowhere.test"), "{err}");

    let empty = StaticResolver::new([("empty.test", vec![])]);
    let err = endpoints(&["http://empty.test:1".into()], &empty)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty.test resolves to no address"), "{err}");
}
