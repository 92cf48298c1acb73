//! The `[tls]` table: mutual TLS between hosts (issue 26). One table for
//! the three services: each presents `cert` (with `key`) and verifies its
//! peer against `ca`.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The `[tls]` table. Off (empty paths) by default, which keeps every
/// link plain TCP and therefore on loopback only unless `insecure`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// This host's certificate chain, PEM (leaf first); "" turns TLS off.
    pub cert: PathBuf,
    /// The private key of `cert`, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates, PEM, that sign the peers' certificates.
    pub ca: PathBuf,
    /// The name the route servers' and reporters' certificates must carry
    /// (the agent checks it); "" checks the address connected to instead.
    pub server_name: String,
    /// The identities (DNS names of a certificate, `*.suffix` for a
    /// domain) the servers accept connections from; empty: any certificate
    /// the CA signed.
    pub peer_names: Vec<String>,
    /// The identities whose statistics may consume a `balance` module's
    /// capacity units (the reporter); empty: nobody (deny by default).
    pub consume_allow: Vec<String>,
    /// Allows plain TCP (no `cert`) on addresses other than loopback; the
    /// services warn at start.
    pub insecure: bool,
}

impl TlsConfig {
    /// Whether TLS is on (`cert` is set).
    pub fn enabled(&self) -> bool {
        !self.cert.as_os_str().is_empty()
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.enabled() {
            for (field, path) in [
                ("tls.cert", &self.cert),
                ("tls.key", &self.key),
                ("tls.ca", &self.ca),
            ] {
                file_path(field, path)?;
            }
        } else if !self.key.as_os_str().is_empty() || !self.ca.as_os_str().is_empty() {
            return Err(ConfigError::Invalid {
                field: "tls.cert",
                value: "\"\"".into(),
                allowed: "a PEM file when tls.key or tls.ca is set (all three, or none)".into(),
            });
        }
        if !self.server_name.is_empty() && !is_dns_name(&self.server_name) {
            return Err(ConfigError::Invalid {
                field: "tls.server_name",
                value: format!("\"{}\"", self.server_name),
                allowed: "a DNS name, e.g. lbagent-server.example, or \"\"".into(),
            });
        }
        patterns("tls.peer_names", &self.peer_names)?;
        patterns("tls.consume_allow", &self.consume_allow)?;
        Ok(())
    }

    /// Checks that a plain-TCP `addr` (`field`) is allowed: TLS is on, the
    /// address is loopback, or `insecure` is set.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `field` and the two ways out.
    pub fn check_plain(&self, field: &'static str, addr: IpAddr) -> Result<(), ConfigError> {
        if self.enabled() || self.insecure || addr.is_loopback() {
            return Ok(());
        }
        Err(ConfigError::Invalid {
            field,
            value: addr.to_string(),
            allowed: "a loopback address while TLS is off: set tls.cert, tls.key and tls.ca \
                      (mutual TLS), or tls.insecure = true to allow plain TCP between hosts"
                .into(),
        })
    }

    /// [`Self::check_plain`] for a `HOST:PORT` endpoint: a literal address
    /// or `localhost`; any other name counts as another host.
    ///
    /// # Errors
    /// As [`Self::check_plain`].
    pub fn check_plain_endpoint(
        &self,
        field: &'static str,
        endpoint: &str,
    ) -> Result<(), ConfigError> {
        let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
        let ip = match (host.parse::<IpAddr>(), endpoint.parse::<SocketAddr>()) {
            (Ok(ip), _) => ip,
            (_, Ok(addr)) => addr.ip(),
            _ if host == "localhost" => return Ok(()),
            _ => IpAddr::from([192, 0, 2, 0]),
        };
        self.check_plain(field, ip).map_err(|e| match e {
            ConfigError::Invalid { field, allowed, .. } => ConfigError::Invalid {
                field,
                value: format!("\"{endpoint}\""),
                allowed,
            },
            other => other,
        })
    }
}

/// Whether `name` matches `pattern`: equal (ASCII case-insensitive), or
/// `*.suffix` and `name` ends in `.suffix` with something before it.
/// Pure.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            name.len() > suffix.len() + 1 && {
                let (head, tail) = name.split_at(name.len() - suffix.len());
                head.ends_with('.') && tail.eq_ignore_ascii_case(suffix)
            }
        }
        None => pattern.eq_ignore_ascii_case(name),
    }
}

fn file_path(field: &'static str, p: &Path) -> Result<(), ConfigError> {
    if p.as_os_str().is_empty() || !p.is_absolute() {
        return Err(ConfigError::Invalid {
            field,
            value: format!("\"{}\"", p.display()),
            allowed: "the absolute path of a PEM file (tls.cert, tls.key and tls.ca go together)"
                .into(),
        });
    }
    Ok(())
}

fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

fn patterns(field: &'static str, list: &[String]) -> Result<(), ConfigError> {
    for p in list {
        let name = p.strip_prefix("*.").unwrap_or(p);
        if !is_dns_name(name) {
            return Err(ConfigError::Invalid {
                field,
                value: format!("\"{p}\""),
                allowed: "DNS names (a certificate's SAN), or *.DOMAIN for every name under it"
                    .into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_matches_its_name_or_the_names_under_its_domain() {
        assert!(name_matches(
            "agent-1.fleet.example",
            "AGENT-1.fleet.example"
        ));
        assert!(!name_matches(
            "agent-1.fleet.example",
            "agent-2.fleet.example"
        ));
        assert!(name_matches("*.fleet.example", "agent-1.fleet.example"));
        assert!(name_matches("*.fleet.example", "a.b.fleet.example"));
        assert!(!name_matches("*.fleet.example", "fleet.example"));
        assert!(!name_matches("*.fleet.example", "evilfleet.example"));
        assert!(!name_matches("*.fleet.example", ".fleet.example"));
    }

    #[test]
    fn plain_tcp_beyond_loopback_needs_insecure_or_tls() {
        let mut t = TlsConfig::default();
        assert!(t
            .check_plain("dnsserver.listen", [127, 0, 0, 1].into())
            .is_ok());
        let err = t
            .check_plain("dnsserver.listen", [0, 0, 0, 0].into())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dnsserver.listen") && err.contains("tls.insecure"),
            "{err}"
        );
        assert!(t
            .check_plain_endpoint("agent.reporters", "localhost:7778")
            .is_ok());
        assert!(t
            .check_plain_endpoint("agent.reporters", "127.0.0.1:7778")
            .is_ok());
        assert!(t
            .check_plain_endpoint("agent.reporters", "reporter.example:7778")
            .is_err());
        assert!(t
            .check_plain_endpoint("agent.reporters", "10.0.0.1:7778")
            .is_err());
        t.insecure = true;
        assert!(t
            .check_plain_endpoint("agent.reporters", "10.0.0.1:7778")
            .is_ok());
        t.insecure = false;
        t.cert = "/etc/lbagent/tls/host.pem".into();
        t.key = "/etc/lbagent/tls/host.key".into();
        t.ca = "/etc/lbagent/tls/ca.pem".into();
        assert!(t.validate().is_ok());
        assert!(t
            .check_plain("reporter.listen", [10, 0, 0, 1].into())
            .is_ok());
    }

    #[test]
    fn the_three_files_go_together_and_names_are_dns_names() {
        let t = TlsConfig {
            key: "/k.pem".into(),
            ..TlsConfig::default()
        };
        assert!(t.validate().unwrap_err().to_string().contains("tls.cert"));
        let t = TlsConfig {
            cert: "relative.pem".into(),
            key: "/k.pem".into(),
            ca: "/ca.pem".into(),
            ..TlsConfig::default()
        };
        assert!(t.validate().unwrap_err().to_string().contains("absolute"));
        let t = TlsConfig {
            consume_allow: vec!["bad name!".into()],
            ..TlsConfig::default()
        };
        assert!(t
            .validate()
            .unwrap_err()
            .to_string()
            .contains("tls.consume_allow"));
    }
}
