//! One connection, plain or TLS, as one futures-io stream, so the shells
//! keep one code path: [`Stream`] reads and writes either way. The TLS
//! variants are `futures-rustls` over glommio's `TcpStream`; reads are
//! cancel-safe as glommio's are (a record half read stays in the
//! connection's buffer).
//!
//! A TLS write may leave ciphertext buffered: write with [`send`], which
//! flushes, never with a bare `write_all`.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_lite::{AsyncRead, AsyncWrite, AsyncWriteExt};
use glommio::net::TcpStream;

use super::{refusal, Identity, Side};

/// A connection: plain TCP, or TLS as the client or the server.
pub enum Stream {
    /// Plain TCP (TLS off: loopback, or `tls.insecure`).
    Plain(TcpStream),
    /// TLS, we are the client.
    Client(Box<futures_rustls::client::TlsStream<TcpStream>>),
    /// TLS, we are the server; the peer's identity beside it.
    Server(Box<futures_rustls::server::TlsStream<TcpStream>>, Identity),
}

impl Stream {
    /// The TCP connection under it.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Client(s) => s.get_ref().0,
            Stream::Server(s, _) => s.get_ref().0,
        }
    }

    /// The peer's identity, when it presented a certificate (a server's
    /// TLS connection).
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            Stream::Server(_, id) => Some(id),
            _ => None,
        }
    }
}

/// Writes all of `bytes` and flushes (TLS buffers ciphertext otherwise).
///
/// # Errors
/// The socket's error.
pub async fn send(stream: &mut Stream, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

/// A TLS error on an established connection, said as a handshake refusal
/// is (in TLS 1.3 a client learns that the server refused its certificate
/// at its first read, from the alert).
fn explained(e: io::Error, side: Side) -> io::Error {
    let tls = e
        .get_ref()
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some());
    if !tls {
        return e;
    }
    io::Error::new(e.kind(), format!("TLS: {}", refusal::why(&e, side)))
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut())
                .poll_read(cx, buf)
                .map_err(|e| explained(e, Side::Client)),
            Stream::Server(s, _) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Server(s, _) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Server(s, _) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_close(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_close(cx),
            Stream::Server(s, _) => Pin::new(s.as_mut()).poll_close(cx),
        }
    }
}
