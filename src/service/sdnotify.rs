//! systemd's service notification protocol (`sd_notify(3)`): one datagram
//! such as `READY=1` or `WATCHDOG=1` to the Unix socket named by
//! `$NOTIFY_SOCKET`. A name starting with `@` is in the abstract namespace.
//! Without `$NOTIFY_SOCKET` (not started by systemd with `Type=notify`)
//! every call is a no-op.
//!
//! The watchdog interval comes from `$WATCHDOG_USEC` (set by `WatchdogSec=`),
//! honoured only when `$WATCHDOG_PID` is unset or names this process.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::PathBuf;
use std::time::Duration;

/// The environment variable naming the notification socket.
pub const NOTIFY_SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Where notifications go: nowhere (no-op) or one socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Not started by systemd: notifications are dropped.
    None,
    /// A socket path in the file system.
    Path(PathBuf),
    /// A name in Linux's abstract socket namespace (`@name`, without the `@`).
    Abstract(Vec<u8>),
}

impl Target {
    /// The target `$NOTIFY_SOCKET` names (an empty value is [`Target::None`]).
    pub fn from_env() -> Target {
        match std::env::var_os(NOTIFY_SOCKET_ENV) {
            Some(v) => Target::parse(&v.to_string_lossy()),
            None => Target::None,
        }
    }

    /// The target a `$NOTIFY_SOCKET` value names.
    pub fn parse(value: &str) -> Target {
        if value.is_empty() {
            Target::None
        } else if let Some(name) = value.strip_prefix('@') {
            Target::Abstract(name.as_bytes().to_vec())
        } else {
            Target::Path(PathBuf::from(value))
        }
    }
}

/// Sends notifications to one [`Target`].
#[derive(Debug)]
pub struct Notifier {
    target: Target,
    socket: Option<UnixDatagram>,
}

impl Notifier {
    /// A notifier for `$NOTIFY_SOCKET` (a no-op one when it is unset).
    pub fn from_env() -> Notifier {
        Notifier::new(Target::from_env())
    }

    /// A notifier for `target`.
    pub fn new(target: Target) -> Notifier {
        let socket = match target {
            Target::None => None,
            _ => UnixDatagram::unbound().ok(),
        };
        Notifier { target, socket }
    }

    /// Whether notifications go anywhere.
    pub fn enabled(&self) -> bool {
        self.target != Target::None
    }

    /// Sends `state` (newline-separated `KEY=VALUE` pairs) in one datagram.
    ///
    /// # Errors
    /// The socket cannot be created or the datagram not sent (systemd gone,
    /// a wrong path). Without a target it does nothing and succeeds.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let addr = match &self.target {
            Target::None => return Ok(()),
            Target::Path(p) => SocketAddr::from_pathname(p)?,
            Target::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name)?
            }
        };
        let socket = self
            .socket
            .as_ref()
            .ok_or_else(|| io::Error::other("cannot create a Unix datagram socket"))?;
        socket.send_to_addr(state.as_bytes(), &addr)?;
        Ok(())
    }

    /// [`Self::notify`], logging a failure (a warning) instead of
    /// returning it: a service must keep serving when systemd cannot hear it.
    pub fn notify_or_log(&self, who: &str, state: &str) {
        if let Err(e) = self.notify(state) {
            tracing::warn!(
                "{who}: cannot notify systemd ({state:?} to {:?}): {e}",
                self.target
            );
        }
    }
}

/// Tells systemd (if it started us) that the service is ready; `who` names
/// the service in a failure's log line.
pub fn ready(who: &str) {
    Notifier::from_env().notify_or_log(who, "READY=1");
}

/// The watchdog interval systemd expects pings within: `$WATCHDOG_USEC`,
/// when set, positive, and meant for this process (`$WATCHDOG_PID` unset or
/// equal to our pid).
pub fn watchdog_interval() -> Option<Duration> {
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    parse_watchdog(usec.as_deref(), pid.as_deref(), std::process::id())
}

/// [`watchdog_interval`] on given values (pure, for tests).
pub fn parse_watchdog(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok()? != me {
            return None;
        }
    }
    let usec: u64 = usec?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).expect("a notification arrives");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn parses_the_socket_names() {
        assert_eq!(Target::parse(""), Target::None);
        assert_eq!(
            Target::parse("/run/systemd/notify"),
            Target::Path("/run/systemd/notify".into())
        );
        assert_eq!(
            Target::parse("@/org/x/notify"),
            Target::Abstract(b"/org/x/notify".to_vec())
        );
    }

    #[test]
    fn sends_to_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::new(Target::Path(path));
        assert!(n.enabled());
        n.notify("READY=1").unwrap();
        assert_eq!(recv(&sock), "READY=1");
        n.notify("WATCHDOG=1").unwrap();
        assert_eq!(recv(&sock), "WATCHDOG=1");
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("lbagent-sdnotify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let sock = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier::new(Target::parse(&format!("@{name}")));
        n.notify("READY=1").unwrap();
        assert_eq!(recv(&sock), "READY=1");
    }

    #[test]
    fn without_a_target_it_does_nothing() {
        let n = Notifier::new(Target::None);
        assert!(!n.enabled());
        n.notify("READY=1").unwrap();
    }

    #[test]
    fn a_missing_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let n = Notifier::new(Target::Path(dir.path().join("absent")));
        assert!(n.notify("READY=1").is_err());
        // The logging form does not panic.
        n.notify_or_log("test", "READY=1");
    }

    #[test]
    fn reads_the_watchdog_interval() {
        let me = 42;
        assert_eq!(parse_watchdog(None, None, me), None);
        assert_eq!(
            parse_watchdog(Some("30000000"), None, me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_watchdog(Some("30000000"), Some("42"), me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(parse_watchdog(Some("30000000"), Some("41"), me), None);
        assert_eq!(parse_watchdog(Some("0"), None, me), None);
        assert_eq!(parse_watchdog(Some("soon"), None, me), None);
        assert_eq!(parse_watchdog(Some("1"), Some("x"), me), None);
    }
}
