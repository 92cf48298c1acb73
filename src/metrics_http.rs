//! The one HTTP exchange the metrics endpoints of the agent, the route
//! server and the reporter serve: read a request head, answer `GET
//! /metrics` with the Prometheus text and anything else with 404. Pure:
//! each server's shell reads and writes the socket its own way.

/// The longest request head read; a longer one is answered as it stands.
pub const MAX_REQUEST_HEAD: usize = 8192;

/// Whether `req` holds a whole request head (or as much as will be read).
pub fn head_complete(req: &[u8]) -> bool {
    req.len() >= MAX_REQUEST_HEAD || req.windows(4).any(|w| w == b"\r\n\r\n")
}

/// The whole response to `req`: `GET /metrics` gets `body()` as
/// Prometheus text (version 0.0.4), anything else a 404 saying where the
/// metrics are. `body` runs only for a metrics request.
pub fn response(req: &[u8], body: impl FnOnce() -> String) -> String {
    if req.starts_with(b"GET /metrics ") || req.starts_with(b"GET /metrics?") {
        let body = body();
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        let msg = "not found: the metrics are at GET /metrics\n";
        format!(
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
            msg.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_get_the_text_and_other_paths_a_404() {
        let ok = response(b"GET /metrics HTTP/1.1\r\n\r\n", || "a 1\n".into());
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("Content-Length: 4\r\nConnection: close\r\n\r\na 1\n"));
        assert!(response(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n", String::new).contains("200 OK"));
        let nf = response(b"GET /other HTTP/1.1\r\n\r\n", || unreachable!());
        assert!(nf.starts_with("HTTP/1.1 404 Not Found\r\n"), "{nf}");
        assert!(response(b"POST /metrics HTTP/1.1\r\n\r\n", String::new).contains("404"));
    }

    #[test]
    fn a_head_is_complete_at_its_blank_line_or_at_the_bound() {
        assert!(!head_complete(b"GET /metrics HTTP/1.1\r\n"));
        assert!(head_complete(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(head_complete(&[b'a'; MAX_REQUEST_HEAD]));
    }
}
