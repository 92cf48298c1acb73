//! Where the store is: `sqlite:PATH` or a `postgres://` URL, parsed and
//! shown with its password hidden. Here, below the store, so that the
//! configuration checks a URL without linking SQLite or PostgreSQL; the
//! store re-exports it (`lbagent_store::StoreUrl`).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// A store URL that is neither `sqlite:PATH` nor a `postgres://` URL; the
/// message says what was wrong and what to write.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadStoreUrl(pub String);

/// Where the store is: parsed from `sqlite:PATH` or a `postgres://` URL.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// The embedded SQLite database file (created with its directory).
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (`postgres://` or `postgresql://`).
    Postgres(String),
}

impl FromStr for StoreUrl {
    type Err = BadStoreUrl;

    fn from_str(s: &str) -> Result<Self, BadStoreUrl> {
        if let Some(path) = s.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err(BadStoreUrl(format!(
                    "`{s}` has no path: write sqlite:PATH, e.g. sqlite:./lbagent-data/lbagent.db"
                )));
            }
            return Ok(StoreUrl::Sqlite(PathBuf::from(path)));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(StoreUrl::Postgres(s.to_string()));
        }
        Err(BadStoreUrl(format!(
            "`{s}` is neither sqlite:PATH nor a postgres:// URL"
        )))
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Sqlite(p) => write!(f, "sqlite:{}", p.display()),
            StoreUrl::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A URL with its password replaced by `***`, for logs and errors: the
/// one in `user:password@` and a `password=` query parameter.
pub fn redact(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, q)) => (u, Some(q)),
        None => (url, None),
    };
    let mut out = redact_userinfo(url);
    if let Some(q) = query {
        out.push('?');
        let params: Vec<String> = q
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => p.to_string(),
            })
            .collect();
        out.push_str(&params.join("&"));
    }
    out
}

fn redact_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some(parts) => parts,
        None => return url.to_string(),
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}
