//! Binding a test server's listener again on the port of its earlier run.
//! The test servers that restart on the same port (`reportsink.rs`,
//! `routesrc.rs`) use it as `crate::rebind`: a test file that includes
//! either includes this too, with
//! `#[path = "support/rebind.rs"] mod rebind;`.

use std::io;
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

/// Binds `127.0.0.1:port`; a port other than 0 (the one of an earlier run,
/// which clients are told to dial) is retried while in use, for up to 30 s:
/// while it was free, a test beside this one binding port 0 or connecting
/// out may have been handed it, and such a holder lets go again.
pub fn bind_again(port: u16) -> io::Result<TcpListener> {
    let t0 = Instant::now();
    loop {
        match TcpListener::bind(("127.0.0.1", port)) {
            Err(e)
                if port != 0
                    && e.kind() == io::ErrorKind::AddrInUse
                    && t0.elapsed() < Duration::from_secs(30) =>
            {
                thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}
