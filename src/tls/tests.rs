//! Handshakes over loopback between two [`Tls`]s made from test
//! certificates: who is refused, with which line, and what a rotation
//! changes.

use std::net::SocketAddr;
use std::path::Path;

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::LocalExecutorBuilder;

use super::testing::{TestCa, Validity};
use super::*;

fn on_executor<T, F>(f: impl FnOnce() -> F + Send + 'static) -> T
where
    T: Send + 'static,
    F: std::future::Future<Output = T> + 'static,
{
    LocalExecutorBuilder::default()
        .io_memory(64 << 10)
        .spawn(f)
        .expect("an executor")
        .join()
        .expect("the executor ran")
}

/// Serves one connection with `server`: the handshake's result, and an
/// echo of one message when it succeeded.
async fn serve_one(listener: &TcpListener, server: Option<&Tls>) -> Result<Identity, String> {
    let tcp = listener.accept().await.expect("a connection");
    let mut stream = accept(server, tcp).await?;
    let mut buf = [0u8; 5];
    stream
        .read_exact(&mut buf)
        .await
        .map_err(|e| e.to_string())?;
    send(&mut stream, &buf).await.map_err(|e| e.to_string())?;
    Ok(stream.identity().cloned().unwrap_or_default())
}

async fn client_one(addr: SocketAddr, client: Option<&Tls>) -> io::Result<[u8; 5]> {
    let tcp = TcpStream::connect(addr).await?;
    let mut stream = connect(client, tcp, addr).await?;
    send(&mut stream, b"hello").await?;
    let mut buf = [0u8; 5];
    stream.read_exact(&mut buf).await?;
    Ok(buf)
}

/// The server's and the client's outcome of one connection.
fn exchange(
    server: TlsConfig,
    client: TlsConfig,
) -> (Result<Identity, String>, io::Result<[u8; 5]>) {
    on_executor(move || async move {
        let server = Tls::load(&server).expect("the server's files load");
        let client = Tls::load(&client).expect("the client's files load");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let c = glommio::spawn_local(async move { client_one(addr, Some(&client)).await });
        let s = serve_one(&listener, Some(&server)).await;
        (s, c.await)
    })
}

fn fleet(dir: &Path, ca: &TestCa) -> TlsConfig {
    ca.write(
        dir,
        "server",
        &["127.0.0.1", "server.fleet.test"],
        Validity::Now,
    )
}

#[test]
fn a_client_of_the_fleets_ca_is_served_and_known_by_its_names() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fleet");
    let server = fleet(dir.path(), &ca);
    let client = ca.write(
        dir.path(),
        "agent",
        &["agent-1.fleet.test", "127.0.0.1"],
        Validity::Now,
    );
    let (s, c) = exchange(server, client);
    let identity = s.expect("served");
    assert_eq!(identity.names(), ["agent-1.fleet.test"]);
    assert_eq!(identity.ip(), Some("127.0.0.1".parse().unwrap()));
    assert_eq!(&c.expect("answered"), b"hello");
}

#[test]
fn expired_not_yet_valid_and_foreign_client_certificates_are_refused_naming_why() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fleet");
    let other = TestCa::new("elsewhere");
    for (stem, signer, validity, expect) in [
        ("expired", &ca, Validity::Expired, "has expired"),
        ("early", &ca, Validity::NotYet, "not valid yet"),
        ("foreign", &other, Validity::Now, "wrong CA"),
    ] {
        let server = fleet(dir.path(), &ca);
        let mut client = signer.write(dir.path(), stem, &["agent-1.fleet.test"], validity);
        // The client trusts the fleet's CA: only its own certificate is wrong.
        client.ca = server.ca.clone();
        let (s, c) = exchange(server, client);
        let why = s.expect_err(stem);
        assert!(
            why.contains("the client's certificate") && why.contains(expect),
            "{stem}: {why}"
        );
        assert!(c.is_err(), "{stem}: the client is not answered");
    }
}

#[test]
fn a_client_named_outside_peer_names_is_refused_in_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fleet");
    let mut server = fleet(dir.path(), &ca);
    server.peer_names = vec!["*.fleet.test".into()];
    let client = ca.write(dir.path(), "intruder", &["intruder.example"], Validity::Now);
    let (s, c) = exchange(server.clone(), client);
    let why = s.expect_err("refused");
    assert!(
        why.contains("wrong name") && why.contains("intruder.example"),
        "{why}"
    );
    // TLS 1.3: the client learns it at its first read, from the alert.
    let err = c.expect_err("refused").to_string();
    assert!(err.contains("the peer refused the handshake"), "{err}");
    let ok = ca.write(dir.path(), "agent", &["agent-7.fleet.test"], Validity::Now);
    assert!(exchange(server, ok).0.is_ok());
}

#[test]
fn a_server_certificate_of_another_name_is_refused_by_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fleet");
    let server = ca.write(
        dir.path(),
        "server",
        &["10.9.9.9", "elsewhere.test"],
        Validity::Now,
    );
    let client = ca.write(dir.path(), "agent", &["agent-1.fleet.test"], Validity::Now);
    let (_, c) = exchange(server, client);
    let err = c.expect_err("refused").to_string();
    assert!(
        err.contains("server's certificate") && err.contains("wrong name"),
        "{err}"
    );
}

#[test]
fn a_plain_tcp_client_is_refused_at_its_first_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fleet");
    let server = fleet(dir.path(), &ca);
    let why = on_executor(move || async move {
        let server = Tls::load(&server).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let c = glommio::spawn_local(async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            // A StatsReport frame's length prefix and the start of its body.
            let _ = tcp
                .write_all(&[0x40, 0, 0, 0, 0x10, 0, 0, 0, b'L', b'B'])
                .await;
            let mut buf = [0u8; 64];
            let _ = tcp.read(&mut buf).await;
        });
        let s = serve_one(&listener, Some(&server)).await;
        c.await;
        s
    });
    let why = why.expect_err("refused");
    assert!(why.contains("plain TCP"), "{why}");
}

#[test]
fn rotated_files_serve_new_connections_and_live_ones_keep_going() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = TestCa::new("fleet-2025");
    let server_cfg = fleet(dir.path(), &old_ca);
    let client_cfg = old_ca.write(dir.path(), "agent", &["agent-1.fleet.test"], Validity::Now);
    let new_ca = TestCa::new("fleet-2026");
    let names = on_executor(move || async move {
        let server = Tls::load(&server_cfg).unwrap();
        let client = Tls::load(&client_cfg).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (live_client, live_server) =
            futures_lite::future::zip(connect(Some(&client), tcp, addr), async {
                accept(Some(&server), listener.accept().await.unwrap()).await
            })
            .await;
        let (mut live_client, mut live_server) = (live_client.unwrap(), live_server.unwrap());
        // Both sides rotate to the new CA's certificates (files rewritten).
        let both = [
            ("server", &["127.0.0.1", "server.fleet.test"][..]),
            ("agent", &["agent-2.fleet.test"][..]),
        ];
        for (stem, names) in both {
            new_ca.write(
                server_cfg.cert.parent().unwrap(),
                stem,
                names,
                Validity::Now,
            );
        }
        // The live connection still carries bytes both ways.
        send(&mut live_client, b"still").await.unwrap();
        let mut buf = [0u8; 5];
        live_server.read_exact(&mut buf).await.unwrap();
        send(&mut live_server, &buf).await.unwrap();
        live_client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"still");
        // A new connection uses the new files on both sides.
        let c = glommio::spawn_local(async move { client_one(addr, Some(&client)).await });
        let s = serve_one(&listener, Some(&server)).await;
        assert!(c.await.is_ok());
        s.expect("served with the new files").names().to_vec()
    });
    assert_eq!(names, ["agent-2.fleet.test"]);
}

#[test]
fn files_that_do_not_load_keep_the_previous_ones() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fleet");
    let server = fleet(dir.path(), &ca);
    let client = ca.write(dir.path(), "agent", &["agent-1.fleet.test"], Validity::Now);
    let tls = Tls::load(&server).unwrap();
    std::fs::write(&server.key, "not a key").unwrap();
    tls.refresh();
    tls.reload();
    // Still serving with what it had.
    let (s, c) = on_executor(move || async move {
        let client = Tls::load(&client).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let c = glommio::spawn_local(async move { client_one(addr, Some(&client)).await });
        let s = serve_one(&listener, Some(&tls)).await;
        (s, c.await)
    });
    assert!(s.is_ok() && c.is_ok());
    let err = Tls::load(&server).unwrap_err().to_string();
    assert!(
        err.contains("tls.key") && err.contains(&server.key.display().to_string()),
        "{err}"
    );
}
