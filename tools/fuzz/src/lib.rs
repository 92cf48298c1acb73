//! What each fuzz target checks, as plain functions: the `fuzz_*` binaries
//! hand AFL's inputs to them, and `seeds` writes their starting corpora
//! from real encoded messages and files ([`seeds`]).
//!
//! Every check panics (which AFL records as a crash) when a parser panics,
//! aborts or breaks one of its invariants; an input the parser rightly
//! rejects is not a finding.

#![warn(missing_docs)]

pub mod seeds;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lbagent::host::heartbeat::{self, HeartbeatReader};
use lbagent::host::snapshot;
use lbagent::client::{Client, ClientError, ClientOptions};
use lbagent::config::Config;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{
    decode, fb, AdmissionLevel, CacheRoute, Encoder, FrameDecoder, FrameError, Limits, Message,
    ModuleStats, NodeStats, NodeStatus, Report, MAX_FRAME_LEN,
};

/// A scratch directory for the targets that need files, one per process
/// (AFL runs one process per fuzzer instance): under `$LBAGENT_FUZZ_SCRATCH`
/// when set (tools/fuzz.sh sets it and removes it after the run), else on
/// tmpfs when there is one.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if let Some(dir) = std::env::var_os("LBAGENT_FUZZ_SCRATCH") {
            PathBuf::from(dir)
        } else if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("lbagent-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    })
}

/// Mode 0644 whatever the umask: a reader trusts no file that others can
/// write (`lbagent::host::owned`), and the targets test the reader, not that.
fn owners_only(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .expect("set the scratch file's mode");
}

// === datagrams and frames ===

/// A datagram as the agent or the client receives it: decoded under the UDP
/// limits; a message that decodes is walked field by field, validated when
/// it is a request, and re-encoded, and the re-encoding must decode to the
/// same fields. The shard's hot-path reader is held to the decoder
/// ([`hot`]). The same bytes are also read as a shared-memory cell of the
/// fixed layout ([`fixed_record`]).
pub fn datagram(data: &[u8]) {
    message(data, &Limits::UDP);
    fixed_record(data);
    hot(data);
}

/// The shard's hot path ([`lbagent::wire::read_hot`]: a plain getHost or
/// a report read from the bytes without the verifier) against the
/// verified decode and `validate()`: the same answer on every input.
/// Whatever the reader accepts the decoder must accept with the same
/// values, and whatever plain getHost or report the decoder accepts and
/// validates the reader must read.
pub fn hot(data: &[u8]) {
    use lbagent::wire::{read_hot, Hot};
    let read = read_hot(data, &Limits::UDP);
    let full = match decode(data, &Limits::UDP) {
        Ok(Message::GetHostReq(r)) if !r.may_steer() => r.validate().ok().map(Hot::GetHost),
        Ok(Message::ReportReq(r)) => r.validate().ok().map(Hot::Report),
        _ => None,
    };
    assert_eq!(
        read, full,
        "the hot path and the verified decode read these bytes differently"
    );
}

/// A shared-memory cell read as a record of the fixed layout
/// ([`lbagent::shm::fixed`]), as the shard reads a request and the client
/// an answer: a record that decodes must encode back to the same bytes, and
/// a request must be the one its FlatBuffers datagram decodes to.
pub fn fixed_record(data: &[u8]) {
    use lbagent::shm::fixed;
    if let Ok((req, hint)) = fixed::decode_request_hinted(data) {
        let mut out = [0u8; fixed::MAX_LEN];
        let n = fixed::encode_request_hinted(&req, hint, &mut out);
        assert_eq!(&out[..n], data, "a request record that does not encode back");
        let mut e = Encoder::new();
        let flat = match req {
            fixed::Request::GetHost(g) => e
                .get_host_req(g.seq, g.module, g.business_priority, g.user_priority)
                .to_vec(),
            fixed::Request::Report(r) => e.report_req(&r).to_vec(),
        };
        let msg = decode(&flat, &Limits::UDP).expect("an encoded request decodes");
        assert_eq!(
            fixed::from_message(&msg),
            Some(req),
            "the fixed record and its FlatBuffers datagram read differently"
        );
    }
    if let Ok((a, hint)) = fixed::decode_answer_hinted(data) {
        let mut out = [0u8; fixed::ANSWER_MAX];
        let n = fixed::write_answer(&mut out, a.seq, a.module, a.retcode, a.host, a.level, hint);
        assert_eq!(&out[..n], data, "an answer record that does not encode back");
    }
}

/// A TCP byte stream cut into frames by [`FrameDecoder`], fed in chunks
/// whose sizes the input's first byte chooses. The frames must be exactly
/// those a straightforward reading of the stream gives, the decoder must
/// stop at the same bad prefix, and every frame is checked as a message
/// under the TCP limits.
pub fn frame(data: &[u8]) {
    let Some((&chunk_seed, stream)) = data.split_first() else {
        return;
    };
    let expected = reference_frames(stream);
    let mut frames = FrameDecoder::default();
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut error = None;
    let chunk = usize::from(chunk_seed % 32) + 1;
    'feed: for piece in stream.chunks(chunk) {
        frames.feed(piece);
        loop {
            match frames.next_frame() {
                Ok(Some(f)) => {
                    assert!(!f.is_empty() && f.len() <= MAX_FRAME_LEN);
                    got.push(f.to_vec());
                }
                Ok(None) => break,
                Err(e) => {
                    // The error repeats: the stream cannot go on.
                    assert_eq!(frames.next_frame(), Err(e));
                    error = Some(e);
                    break 'feed;
                }
            }
        }
    }
    assert_eq!(
        (&got, error),
        (&expected.0, expected.1),
        "frames differ from the stream"
    );
    if error.is_none() {
        let used: usize = got.iter().map(|f| f.len() + 4).sum();
        assert_eq!(frames.buffered(), stream.len() - used);
    }
    for f in &got {
        message(f, &Limits::TCP_FRAME);
    }
}

/// The frames of `stream` and the error that ends it, read the obvious way.
fn reference_frames(stream: &[u8]) -> (Vec<Vec<u8>>, Option<FrameError>) {
    let mut out = Vec::new();
    let mut rest = stream;
    while rest.len() >= 4 {
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        if len == 0 {
            return (out, Some(FrameError::Empty));
        }
        if len > MAX_FRAME_LEN {
            return (
                out,
                Some(FrameError::Oversized {
                    len,
                    max: MAX_FRAME_LEN,
                }),
            );
        }
        if rest.len() - 4 < len {
            break;
        }
        out.push(rest[4..4 + len].to_vec());
        rest = &rest[4 + len..];
    }
    (out, None)
}

/// Decodes `data` under `limits`; a message is walked, validated and
/// round-tripped through the [`Encoder`].
fn message(data: &[u8], limits: &Limits) {
    let Ok(msg) = decode(data, limits) else {
        return;
    };
    let fields = walk(&msg);
    let mut enc = Encoder::new();
    if let Some(again) = reencode(&msg, &mut enc) {
        let again = decode(again, limits).unwrap_or_else(|e| {
            panic!("{} re-encoded does not decode: {e}", msg.name());
        });
        assert_eq!(
            walk(&again),
            fields,
            "{} changed in a round trip",
            msg.name()
        );
    }
}

fn module(modid: u32, cmdid: u32) -> ModuleId {
    ModuleId::new(modid, cmdid)
}

fn level(l: Option<&fb::AdmissionLevel>) -> Option<AdmissionLevel> {
    l.map(|l| AdmissionLevel {
        business: l.business(),
        user: l.user(),
    })
}

fn route_nodes(v: Option<flatbuffers::Vector<'_, fb::RouteNode>>) -> Vec<RouteNode> {
    v.map(|v| v.iter().map(RouteNode::from).collect())
        .unwrap_or_default()
}

/// Every field of `msg` (an absent vector as empty, an absent string as
/// ""), plus what `validate()` says of a request.
fn walk(msg: &Message<'_>) -> String {
    let mut s = String::new();
    let w = &mut s;
    match msg {
        Message::GetHostReq(m) => {
            let _ = write!(
                w,
                "GetHostReq {} {:?} {} {} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.business_priority(),
                m.user_priority(),
                m.validate()
            );
        }
        Message::GetHostResp(m) => {
            let _ = write!(
                w,
                "GetHostResp {} {:?} {:?} {:?} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.retcode(),
                m.host().map(NodeAddr::from),
                level(m.admission_level())
            );
        }
        Message::ReportReq(m) => {
            let _ = write!(
                w,
                "ReportReq {} {:?} {:?} {} {} {:?} {} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.host().map(NodeAddr::from),
                m.retcode(),
                m.tcost_ms(),
                level(m.downstream_level()),
                m.consumed(),
                m.validate()
            );
        }
        Message::BatchReportReq(m) => {
            let successes: Vec<(NodeAddr, u32)> = m
                .successes()
                .map(|v| v.iter().map(|h| (h.host().into(), h.count())).collect())
                .unwrap_or_default();
            let valid = m.validate().map(|b| (b.seq, b.module));
            let _ = write!(
                w,
                "BatchReportReq {} {:?} {successes:?} {valid:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
            );
        }
        Message::RegisterReq(m) => {
            let _ = write!(
                w,
                "RegisterReq {} {:?} {} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.timeout_ms(),
                m.validate()
            );
        }
        Message::RegisterResp(m) => {
            let _ = write!(
                w,
                "RegisterResp {} {:?} {:?} {}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.retcode(),
                m.version()
            );
        }
        Message::GetRouteReq(m) => {
            let _ = write!(
                w,
                "GetRouteReq {} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid())
            );
        }
        Message::GetRouteResp(m) => {
            let nodes: Vec<NodeStatus> = m
                .nodes()
                .map(|v| v.iter().map(NodeStatus::from).collect())
                .unwrap_or_default();
            let _ = write!(
                w,
                "GetRouteResp {} {:?} {:?} {} {nodes:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.retcode(),
                m.version()
            );
        }
        Message::CacheGetRouteReq(m) => {
            let _ = write!(
                w,
                "CacheGetRouteReq {} {:?} {}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.known_version()
            );
        }
        Message::CacheGetRouteResp(m) => {
            let _ = write!(
                w,
                "CacheGetRouteResp {} {:?} {:?} {} {} {} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.retcode(),
                m.version(),
                m.unchanged(),
                m.any_overloaded(),
                route_nodes(m.nodes())
            );
        }
        Message::ErrorResp(m) => {
            let _ = write!(
                w,
                "ErrorResp {} {:?} {:?} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.retcode(),
                m.message().unwrap_or("")
            );
        }
        Message::PullReq(m) => {
            let modules: Vec<ModuleId> = m
                .modules()
                .map(|v| v.iter().map(ModuleId::from).collect())
                .unwrap_or_default();
            let valid = m.validate().map(|p| (p.seq, p.modules_known().count()));
            let known: Option<Vec<u64>> = m.known_versions().map(|v| v.iter().collect());
            let _ = write!(w, "PullReq {} {modules:?} {known:?} {valid:?}", m.seq());
        }
        Message::RouteAnswer(m) => {
            let _ = write!(
                w,
                "RouteAnswer {} {:?} {} {} {:?}",
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.exists(),
                m.version(),
                route_nodes(m.nodes())
            );
        }
        Message::RoutePush(m) => {
            let _ = write!(
                w,
                "RoutePush {:?} {} {} {:?}",
                module(m.modid(), m.cmdid()),
                m.exists(),
                m.version(),
                route_nodes(m.nodes())
            );
        }
        Message::KeepAlive(m) => {
            let _ = write!(w, "KeepAlive {}", m.seq());
        }
        Message::KeepAliveAck(m) => {
            let _ = write!(w, "KeepAliveAck {}", m.seq());
        }
        Message::StatsReport(m) => {
            let _ = write!(w, "StatsReport {} {} {}", m.seq(), m.caller(), m.time_s());
            for ms in m.modules().iter().flat_map(|v| v.iter()) {
                let nodes: Vec<NodeStats> = ms
                    .nodes()
                    .map(|v| v.iter().map(NodeStats::from).collect())
                    .unwrap_or_default();
                let _ = write!(w, " {:?} {nodes:?}", module(ms.modid(), ms.cmdid()));
            }
        }
        Message::StatsAck(m) => {
            let _ = write!(w, "StatsAck {}", m.seq());
        }
        Message::Unsubscribe(m) => {
            let _ = write!(w, "Unsubscribe {:?}", unsubscribed(m));
        }
        Message::RouteUnchanged(m) => {
            let (modules, versions) = unchanged(m);
            let valid = m.validate().map(|u| u.modules().collect::<Vec<_>>());
            let _ = write!(
                w,
                "RouteUnchanged {} {modules:?} {versions:?} {valid:?}",
                m.seq()
            );
        }
    }
    s
}

/// The modules and versions a RouteUnchanged names (absent vectors as none).
fn unchanged(m: &lbagent::wire::fb::RouteUnchanged<'_>) -> (Vec<ModuleId>, Vec<u64>) {
    let modules = m
        .modules()
        .into_iter()
        .flatten()
        .map(|x| module(x.modid(), x.cmdid()))
        .collect();
    let versions = m.versions().into_iter().flatten().collect();
    (modules, versions)
}

/// The modules an Unsubscribe names (an absent vector as none).
fn unsubscribed(m: &lbagent::wire::fb::Unsubscribe<'_>) -> Vec<ModuleId> {
    m.modules()
        .into_iter()
        .flatten()
        .map(|x| module(x.modid(), x.cmdid()))
        .collect()
}

/// `msg` encoded again by the [`Encoder`], from its fields; `None` where
/// the encoder cannot say what the message says (a report without a host,
/// which no sender writes).
fn reencode<'e>(msg: &Message<'_>, enc: &'e mut Encoder) -> Option<&'e [u8]> {
    Some(match msg {
        Message::GetHostReq(m) => enc.get_host_req(
            m.seq(),
            module(m.modid(), m.cmdid()),
            m.business_priority(),
            m.user_priority(),
        ),
        Message::GetHostResp(m) => enc.get_host_resp(
            m.seq(),
            module(m.modid(), m.cmdid()),
            m.retcode(),
            m.host().map(NodeAddr::from),
            level(m.admission_level()),
        ),
        Message::ReportReq(m) => enc.report_req(&Report {
            seq: m.seq(),
            module: module(m.modid(), m.cmdid()),
            host: NodeAddr::from(m.host()?),
            retcode: m.retcode(),
            tcost_ms: m.tcost_ms(),
            downstream_level: level(m.downstream_level()),
            consumed: m.consumed(),
        }),
        Message::BatchReportReq(m) => {
            let successes: Vec<(NodeAddr, u32)> = m
                .successes()
                .map(|v| v.iter().map(|h| (h.host().into(), h.count())).collect())
                .unwrap_or_default();
            enc.batch_report_req(m.seq(), module(m.modid(), m.cmdid()), &successes)
        }
        Message::RegisterReq(m) => {
            enc.register_req(m.seq(), module(m.modid(), m.cmdid()), m.timeout_ms())
        }
        Message::RegisterResp(m) => enc.register_resp(
            m.seq(),
            module(m.modid(), m.cmdid()),
            m.retcode(),
            m.version(),
        ),
        Message::GetRouteReq(m) => enc.get_route_req(m.seq(), module(m.modid(), m.cmdid())),
        Message::GetRouteResp(m) => {
            let nodes: Vec<NodeStatus> = m
                .nodes()
                .map(|v| v.iter().map(NodeStatus::from).collect())
                .unwrap_or_default();
            enc.get_route_resp(
                m.seq(),
                module(m.modid(), m.cmdid()),
                m.retcode(),
                m.version(),
                &nodes,
            )
        }
        Message::CacheGetRouteReq(m) => {
            enc.cache_get_route_req(m.seq(), module(m.modid(), m.cmdid()), m.known_version())
        }
        Message::CacheGetRouteResp(m) => {
            let nodes = route_nodes(m.nodes());
            enc.cache_get_route_resp(&CacheRoute {
                seq: m.seq(),
                module: module(m.modid(), m.cmdid()),
                retcode: m.retcode(),
                version: m.version(),
                unchanged: m.unchanged(),
                any_overloaded: m.any_overloaded(),
                nodes: &nodes,
            })
        }
        Message::ErrorResp(m) => enc.error_resp(
            m.seq(),
            module(m.modid(), m.cmdid()),
            m.retcode(),
            m.message().unwrap_or(""),
        ),
        Message::PullReq(m) => {
            let modules: Vec<ModuleId> = m
                .modules()
                .map(|v| v.iter().map(ModuleId::from).collect())
                .unwrap_or_default();
            match m.known_versions() {
                None => enc.pull_req(m.seq(), &modules),
                // Not one version per module: no sender writes that.
                Some(v) if v.len() != modules.len() => return None,
                Some(v) => enc.pull_req_known(m.seq(), &modules, &v.iter().collect::<Vec<_>>()),
            }
        }
        Message::RouteAnswer(m) => enc.route_answer(
            m.seq(),
            module(m.modid(), m.cmdid()),
            m.exists(),
            m.version(),
            &route_nodes(m.nodes()),
        ),
        Message::RoutePush(m) => enc.route_push(
            module(m.modid(), m.cmdid()),
            m.exists(),
            m.version(),
            &route_nodes(m.nodes()),
        ),
        Message::KeepAlive(m) => enc.keep_alive(m.seq()),
        Message::KeepAliveAck(m) => enc.keep_alive_ack(m.seq()),
        Message::StatsReport(m) => {
            let per_module: Vec<(ModuleId, Vec<NodeStats>)> = m
                .modules()
                .iter()
                .flat_map(|v| v.iter())
                .map(|ms| {
                    let nodes = ms
                        .nodes()
                        .map(|v| v.iter().map(NodeStats::from).collect())
                        .unwrap_or_default();
                    (module(ms.modid(), ms.cmdid()), nodes)
                })
                .collect();
            let modules: Vec<ModuleStats<'_>> = per_module
                .iter()
                .map(|(module, nodes)| ModuleStats {
                    module: *module,
                    nodes,
                    consumed: &[],
                })
                .collect();
            enc.stats_report_of_run(m.seq(), m.caller(), m.time_s(), m.agent_start(), &modules)
        }
        Message::StatsAck(m) => enc.stats_ack(m.seq()),
        Message::Unsubscribe(m) => enc.unsubscribe(&unsubscribed(m)),
        Message::RouteUnchanged(m) => {
            let (modules, versions) = unchanged(m);
            if modules.len() != versions.len() {
                // Not one version per module: no sender writes that.
                return None;
            }
            enc.route_unchanged(m.seq(), &modules, &versions)
        }
    })
}

// === the heartbeat ===

/// Byte offset of the beat in the heartbeat header.
const HEARTBEAT_BEAT_AT: usize = 32;

/// A heartbeat file holding `data`, its beat set to now when it is long
/// enough to have one (so that the header is read, as a live agent's is):
/// the reader must give a header or a typed error, and the client must
/// either be alive at endpoints that fit (1..=1024 shards, ports within
/// 1..=65535) or say why the agent is down, without sending anything.
pub fn heartbeat(data: &[u8]) {
    let path = scratch().join("heartbeat");
    let mut bytes = data.to_vec();
    let now = unix_ms();
    if let Some(beat) = bytes.get_mut(HEARTBEAT_BEAT_AT..HEARTBEAT_BEAT_AT + 8) {
        beat.copy_from_slice(&now.to_ne_bytes());
    }
    // A new file each time: a reader maps it, and must see only these bytes.
    let _ = std::fs::remove_file(&path);
    std::fs::write(&path, &bytes).expect("write the heartbeat file");
    owners_only(&path);

    if let Ok(reader) = HeartbeatReader::open(&path) {
        assert!(bytes.len() >= heartbeat::HEADER_LEN);
        if let Ok(hb) = reader.read() {
            use std::os::unix::ffi::OsStrExt;
            assert!(
                hb.info.snapshot_path.as_os_str().as_bytes().len() <= heartbeat::SNAPSHOT_PATH_MAX
            );
            assert_eq!(hb.beat_unix_ms, now);
        }
    }

    let mut client = Client::with_options(ClientOptions {
        heartbeat_path: path.clone(),
        snapshot_path: scratch().join("no-routes"),
        static_fallback: false,
        ..ClientOptions::default()
    })
    .expect("client options");
    match client.agent() {
        Ok(info) => {
            assert!((1..=1_024).contains(&info.shards), "{info:?}");
            assert!(info.base_port >= 1, "{info:?}");
            assert!(
                u64::from(info.base_port) + u64::from(info.shards) - 1 <= 65_535,
                "{info:?}"
            );
        }
        Err(ClientError::AgentDown(why)) => assert!(!why.is_empty()),
        Err(other) => panic!("agent(): {other:?}"),
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
        .max(1)
}

// === the static route file ===

/// The static route file's bytes, twice: as they are, and with the
/// checksum made right (so that the fuzzer reaches the routes behind it).
/// A snapshot that decodes must hold sorted, distinct modules with no
/// port 0, answer every module it holds with one of its nodes, and be
/// written back byte for byte by the agent's writer; [`snapshot::read`] of
/// the same bytes on disk must agree with [`snapshot::decode`].
pub fn snapshot(data: &[u8]) {
    snapshot_bytes(data);
    if data.len() >= snapshot::HEADER_LEN {
        let mut sealed = data.to_vec();
        let mut h = crc32fast::Hasher::new();
        h.update(&sealed[..28]);
        h.update(&sealed[snapshot::HEADER_LEN..]);
        let crc = h.finalize();
        sealed[28..32].copy_from_slice(&crc.to_le_bytes());
        snapshot_bytes(&sealed);
    }
}

fn snapshot_bytes(data: &[u8]) {
    let path = Path::new("fuzz-input");
    let decoded = snapshot::decode(path, data);
    let file = scratch().join("routes.snapshot");
    std::fs::write(&file, data).expect("write the snapshot file");
    owners_only(&file);
    let read = snapshot::read(&file);
    match (&decoded, &read) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(_), Err(_)) => {}
        _ => panic!("decode {decoded:?} but read {read:?}"),
    }
    let Ok(snap) = decoded else {
        return;
    };
    for pair in snap.routes.windows(2) {
        assert!(pair[0].module < pair[1].module, "routes out of order");
    }
    for (i, route) in snap.routes.iter().enumerate() {
        assert_eq!(snap.route(route.module), Some(route));
        assert!(route.nodes.iter().all(|n| n.addr.port != 0));
        match snap.random_node(route.module, i as u64) {
            Some(addr) => assert!(route.nodes.iter().any(|n| n.addr == addr)),
            None => assert!(route.nodes.is_empty()),
        }
    }
    let again = scratch().join("rewritten.snapshot");
    snapshot::write(&again, snap.written_unix_s, &snap.routes).expect("write what was read");
    assert_eq!(
        std::fs::read(&again).expect("read back"),
        data,
        "the writer does not reproduce a file the reader accepted"
    );
}

// === the configuration ===

/// The configuration loader: the input up to the first NUL byte is the
/// TOML file, each line after it one `--set SECTION.FIELD=VALUE`. What
/// loads must be valid, and load again to the same configuration from
/// its own TOML.
pub fn config(data: &[u8]) {
    let (text, sets) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let overrides: Vec<String> = String::from_utf8_lossy(sets)
        .lines()
        .map(str::to_string)
        .collect();
    if let Ok(c) = Config::from_toml(text) {
        round_trip(&c);
    }
    let path = scratch().join("lbagent.toml");
    std::fs::write(&path, text).expect("write the config file");
    if let Ok(c) = Config::load(Some(&path), &overrides) {
        round_trip(&c);
    }
}

fn round_trip(c: &Config) {
    c.validate().expect("a loaded configuration is valid");
    let text = toml::to_string(c).expect("a configuration serialises");
    let again = Config::from_toml(&text)
        .unwrap_or_else(|e| panic!("its own TOML does not load: {e}\n{text}"));
    assert_eq!(&again, c, "changed in a TOML round trip");
}

/// What a target runs on one input: returns, or panics on a finding.
pub type Check = fn(&[u8]);

/// Every target by name, with its check.
pub const TARGETS: [(&str, Check); 6] = [
    ("datagram", datagram),
    ("hot", hot),
    ("frame", frame),
    ("heartbeat", heartbeat),
    ("snapshot", snapshot),
    ("config", config),
];

#[cfg(test)]
mod tests {
    #[test]
    fn every_seed_passes_its_check() {
        let dir = std::env::temp_dir().join(format!("lbagent-fuzz-seeds-{}", std::process::id()));
        super::seeds::write_all(&dir).unwrap();
        for (target, check) in super::TARGETS {
            for entry in std::fs::read_dir(dir.join(target)).unwrap() {
                check(&std::fs::read(entry.unwrap().path()).unwrap());
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
