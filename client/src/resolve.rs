//! One `--server` URL → one endpoint per address of its host, so that a DNS name whose A
//! records are all servers (a Kubernetes headless Service) spreads an evaluation over all of
//! them.
//!
//! A URL whose host is an IP literal is used as it is. A host name is looked up once, when the
//! run starts; every address becomes its own [`Client`] pinned to that address
//! (`reqwest`'s per-client DNS override), so the URL — scheme, port, `Host` header, TLS name —
//! stays what was given. IPv4 addresses (A records) are used when there are any, else the IPv6
//! ones: a dual-stack name such as `localhost` is one server, not two.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;

use reqwest::Url;

use crate::http::{Client, ClientConfig, ClientError};

/// Future returned by [`Resolve::lookup`].
pub type Lookup<'a> = Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send + 'a>>;

/// Looks up the addresses of a host name. [`SystemResolver`] asks the operating system; tests
/// inject a [`StaticResolver`].
pub trait Resolve: Send + Sync + fmt::Debug {
    fn lookup<'a>(&'a self, host: &'a str) -> Lookup<'a>;
}

/// The system resolver (`getaddrinfo`, through tokio).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn lookup<'a>(&'a self, host: &'a str) -> Lookup<'a> {
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((host, 0)).await?;
            Ok(addrs.map(|a| a.ip()).collect())
        })
    }
}

/// Fixed answers, for tests: a name not in the map does not resolve.
#[derive(Debug, Clone, Default)]
pub struct StaticResolver(pub HashMap<String, Vec<IpAddr>>);

impl StaticResolver {
    pub fn new<const N: usize>(entries: [(&str, Vec<IpAddr>); N]) -> Self {
        Self(
            entries
                .into_iter()
                .map(|(name, ips)| (name.to_ascii_lowercase(), ips))
                .collect(),
        )
    }
}

impl Resolve for StaticResolver {
    fn lookup<'a>(&'a self, host: &'a str) -> Lookup<'a> {
        let found = self.0.get(&host.to_ascii_lowercase()).cloned();
        Box::pin(async move {
            found.ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such host (static map)")
            })
        })
    }
}

/// One server to send requests to: the URL as given and, for a host name, the address this
/// endpoint connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub addr: Option<SocketAddr>,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            Some(a) => write!(f, "{} via {a}", self.url),
            None => f.write_str(&self.url),
        }
    }
}

/// The endpoints of `servers`, in order, each address once.
pub async fn endpoints(
    servers: &[String],
    resolver: &dyn Resolve,
) -> Result<Vec<Endpoint>, ClientError> {
    let mut out: Vec<Endpoint> = Vec::new();
    for server in servers {
        let parsed = Url::parse(server).map_err(|_| ClientError::BadUrl(server.clone()))?;
        // Normalized (lowercase host, no default port), without the trailing slash.
        let url = parsed.as_str().trim_end_matches('/').to_string();
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ClientError::BadUrl(server.clone()));
        }
        let port = parsed
            .port_or_known_default()
            .ok_or_else(|| ClientError::BadUrl(server.clone()))?;
        let Some(host) = parsed.host_str() else {
            return Err(ClientError::BadUrl(server.clone()));
        };
        // An IP literal (IPv6 ones are bracketed in URLs) needs no lookup.
        if host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok() {
            push_new(&mut out, Endpoint { url, addr: None });
            continue;
        }
        let name = host.to_string();
        let ips = resolver
            .lookup(&name)
            .await
            .map_err(|e| ClientError::Connect {
                url: url.clone(),
                message: format!("cannot resolve {name}: {e}"),
            })?;
        let v4: Vec<IpAddr> = ips.iter().copied().filter(IpAddr::is_ipv4).collect();
        let chosen = if v4.is_empty() { ips } else { v4 };
        if chosen.is_empty() {
            return Err(ClientError::Connect {
                url,
                message: format!("{name} resolves to no address"),
            });
        }
        for ip in chosen {
            push_new(
                &mut out,
                Endpoint {
                    url: url.clone(),
                    addr: Some(SocketAddr::new(ip, port)),
                },
            );
        }
    }
    Ok(out)
}

fn push_new(out: &mut Vec<Endpoint>, e: Endpoint) {
    if !out.contains(&e) {
        out.push(e);
    }
}

/// A [`Client`] per endpoint of `servers` (see the module docs); `base` gives the API key,
/// timeouts and retries.
pub async fn clients(
    servers: &[String],
    base: &ClientConfig,
    resolver: &dyn Resolve,
) -> Result<Vec<Client>, ClientError> {
    endpoints(servers, resolver)
        .await?
        .into_iter()
        .map(|e| {
            Client::new(ClientConfig {
                base_url: e.url,
                connect_to: e.addr,
                ..base.clone()
            })
        })
        .collect()
}
