//! `lbagent._native`: the Python binding of lbagent's client library
//! (PyO3). The package `lbagent` (tools/python/lbagent/) wraps it: the
//! `call` context manager is Python, everything else is here.
//!
//! A `Client` holds one Rust [`Client`] behind a mutex, so one Python
//! object can be shared between threads safely (calls on one object are
//! serialised; give each thread its own for parallel calls). Calls that
//! may wait for the agent (get_host, register, get_route) release the GIL
//! while they wait.

#![warn(missing_docs)]

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use lbagent_admission::AdmissionLevel;
use lbagent_client::{level, Client as RustClient, ClientError, ClientOptions, Host, HostSource};
use lbagent_model::NodeAddr;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(
    lbagent,
    LbError,
    PyException,
    "Base class of every lbagent client error; `code` is the tool commands' exit status."
);
create_exception!(
    lbagent,
    NoSuchModule,
    LbError,
    "The agent has no route for the module (3)."
);
create_exception!(
    lbagent,
    Overloaded,
    LbError,
    "Every node of the module is overloaded (4)."
);
create_exception!(
    lbagent,
    Rejected,
    LbError,
    "The agent's admission control rejected the call (5)."
);
create_exception!(lbagent, AgentDown, LbError, "The local agent is down (6).");
create_exception!(
    lbagent,
    StaticRoutes,
    LbError,
    "The agent is down and the static route file cannot answer (7)."
);
create_exception!(
    lbagent,
    Timeout,
    LbError,
    "The agent did not answer in time (8)."
);
create_exception!(
    lbagent,
    BadResponse,
    LbError,
    "Something that is not the agent answered (9)."
);
create_exception!(
    lbagent,
    BadArgument,
    LbError,
    "A bad argument, or a request the agent refused (10)."
);

/// The Python exception for a client error, with `code` and `kind` set.
fn to_py(py: Python<'_>, e: ClientError) -> PyErr {
    let code = lbagent_client::exit::exit_code(&e);
    let kind = e.kind();
    let msg = e.to_string();
    let err = match e {
        ClientError::NoSuchModule { .. } => NoSuchModule::new_err(msg),
        ClientError::Overloaded { .. } => Overloaded::new_err(msg),
        ClientError::Rejected { .. } => Rejected::new_err(msg),
        ClientError::AgentDown(_) => AgentDown::new_err(msg),
        ClientError::StaticRoutes(_) => StaticRoutes::new_err(msg),
        ClientError::Timeout { .. } => Timeout::new_err(msg),
        ClientError::BadResponse(_) => BadResponse::new_err(msg),
        ClientError::BadRequest(_) => BadArgument::new_err(msg),
    };
    let v = err.value(py);
    // Attributes on a fresh exception object cannot fail in practice; if
    // they did, the exception still says what went wrong.
    let _ = v.setattr("code", code);
    let _ = v.setattr("kind", kind);
    err
}

fn bad(py: Python<'_>, msg: String) -> PyErr {
    to_py(py, ClientError::BadRequest(msg))
}

fn timeout(py: Python<'_>, seconds: f64) -> PyResult<Duration> {
    if !seconds.is_finite() || seconds <= 0.0 || seconds > 3600.0 {
        return Err(bad(
            py,
            format!("timeout {seconds} s is out of range: give 0.001 to 3600 seconds"),
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

fn node(py: Python<'_>, host: (String, u16)) -> PyResult<NodeAddr> {
    let ip: Ipv4Addr = host.0.parse().map_err(|_| {
        bad(
            py,
            format!(
                "host {:?} is not an IPv4 address: pass the (ip, port) get_host returned",
                host.0
            ),
        )
    })?;
    Ok(NodeAddr::new(ip, host.1))
}

/// A user id as Python passes it: `bytes`, or `str` (hashed as its UTF-8).
#[derive(FromPyObject)]
enum UserId {
    #[pyo3(transparent, annotation = "bytes")]
    Bytes(Vec<u8>),
    #[pyo3(transparent, annotation = "str")]
    Text(String),
}

impl UserId {
    fn bytes(&self) -> &[u8] {
        match self {
            UserId::Bytes(b) => b,
            UserId::Text(s) => s.as_bytes(),
        }
    }
}

/// A level from Python: None, or `(B, U)` each 1..=128.
fn level_arg(py: Python<'_>, l: Option<(u8, u8)>, what: &str) -> PyResult<Option<AdmissionLevel>> {
    match l {
        None => Ok(None),
        Some((0, 0)) => Err(bad(
            py,
            format!("{what} (0, 0) is not a level: pass None for no level"),
        )),
        Some((b, u)) => level::decode(&[b, u]).map_err(|e| bad(py, format!("{what}: {e}"))),
    }
}

/// `encode_level(level)`: a service's admission level `(B, U)` (or None)
/// as the two bytes `[B, U]` to attach to a response (`[0, 0]` for
/// None).
#[pyfunction]
#[pyo3(signature = (level))]
fn encode_level(py: Python<'_>, level: Option<(u8, u8)>) -> PyResult<Vec<u8>> {
    let l = level_arg(py, level, "level")?;
    Ok(level::encode(l).to_vec())
}

/// `decode_level(data)`: the level a downstream attached, from the first
/// two bytes of `data` (more bytes are the service's own): `(B, U)`, or
/// None for `[0, 0]`. BadArgument for fewer than two bytes or a part
/// outside 1..=128.
#[pyfunction]
fn decode_level(py: Python<'_>, data: Vec<u8>) -> PyResult<Option<(u8, u8)>> {
    level::decode(&data)
        .map(|l| l.map(|l| (l.business, l.user)))
        .map_err(|e| bad(py, e.to_string()))
}

fn source_name(h: &Host) -> &'static str {
    match h.source {
        HostSource::Agent => "agent",
        HostSource::Cache => "cache",
        HostSource::StaticRoutes => "static_routes",
    }
}

/// A client of the local agent: `Client(heartbeat=None, cache=False,
/// snapshot=None, user_hash_seed=None, user_key_period_s=None)`.
#[pyclass(subclass, module = "lbagent._native")]
struct Client {
    inner: Mutex<RustClient>,
}

impl Client {
    fn with<T>(
        &self,
        py: Python<'_>,
        release_gil: bool,
        f: impl FnOnce(&mut RustClient) -> Result<T, ClientError> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        let run = || {
            let mut c = self
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut c)
        };
        let r = if release_gil {
            py.allow_threads(run)
        } else {
            run()
        };
        r.map_err(|e| to_py(py, e))
    }
}

impl Client {
    /// The getHost of get_host and get_host_source.
    #[allow(clippy::too_many_arguments)]
    fn host(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        timeout: f64,
        business_priority: u8,
        user_priority: u8,
        user_id: Option<UserId>,
    ) -> PyResult<Host> {
        let t = self::timeout(py, timeout)?;
        if user_id.is_some() && user_priority != 0 {
            return Err(bad(
                py,
                "give user_priority or user_id, not both: user_id is hashed to the user priority"
                    .into(),
            ));
        }
        self.with(py, true, |c| match &user_id {
            Some(id) => c.get_host_for_user(modid, cmdid, business_priority, id.bytes(), t),
            None => {
                let o = c.options();
                if (o.business_priority, o.user_priority) != (business_priority, user_priority) {
                    c.set_priorities(business_priority, user_priority)?;
                }
                c.get_host(modid, cmdid, t)
            }
        })
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (heartbeat=None, cache=false, snapshot=None, user_hash_seed=None, user_key_period_s=None))]
    fn new(
        py: Python<'_>,
        heartbeat: Option<PathBuf>,
        cache: bool,
        snapshot: Option<PathBuf>,
        user_hash_seed: Option<u64>,
        user_key_period_s: Option<u64>,
    ) -> PyResult<Self> {
        let mut o = ClientOptions {
            cache,
            ..ClientOptions::default()
        };
        if let Some(p) = heartbeat {
            o.heartbeat_path = p;
        }
        if let Some(p) = snapshot {
            o.snapshot_path = p;
        }
        if let Some(seed) = user_hash_seed {
            o.user_hash_seed = seed;
        }
        if let Some(period) = user_key_period_s {
            o.user_key_period_s = period;
        }
        let c = RustClient::with_options(o).map_err(|e| to_py(py, e))?;
        Ok(Client {
            inner: Mutex::new(c),
        })
    }

    /// A node of module (modid, cmdid) as `(ip, port)`. With `user_id`
    /// (bytes or str) the user priority is the client's keyed hash of it
    /// (give `user_priority` or `user_id`, not both).
    #[pyo3(signature = (modid, cmdid, timeout=1.0, business_priority=0, user_priority=0, user_id=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_host(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        timeout: f64,
        business_priority: u8,
        user_priority: u8,
        user_id: Option<UserId>,
    ) -> PyResult<(String, u16)> {
        let h = self.host(
            py,
            modid,
            cmdid,
            timeout,
            business_priority,
            user_priority,
            user_id,
        )?;
        Ok((h.addr.ipv4().to_string(), h.addr.port))
    }

    /// Like get_host, plus where the node came from: `(ip, port, source)`
    /// with source "agent", "cache" or "static_routes".
    #[pyo3(signature = (modid, cmdid, timeout=1.0, business_priority=0, user_priority=0, user_id=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_host_source(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        timeout: f64,
        business_priority: u8,
        user_priority: u8,
        user_id: Option<UserId>,
    ) -> PyResult<(String, u16, &'static str)> {
        let h = self.host(
            py,
            modid,
            cmdid,
            timeout,
            business_priority,
            user_priority,
            user_id,
        )?;
        Ok((h.addr.ipv4().to_string(), h.addr.port, source_name(&h)))
    }

    /// The node of module (modid, cmdid) that `key` (bytes or str: a
    /// session, a user, a cache key) belongs to, as `(ip, port)`:
    /// consistent hashing, the same node for the same key while it is
    /// idle; adding or removing one node of N moves about 1/N of the keys.
    #[pyo3(signature = (modid, cmdid, key, timeout=1.0))]
    fn get_host_keyed(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        key: UserId,
        timeout: f64,
    ) -> PyResult<(String, u16)> {
        let t = self::timeout(py, timeout)?;
        let h = self.with(py, true, |c| c.get_host_keyed(modid, cmdid, key.bytes(), t))?;
        Ok((h.addr.ipv4().to_string(), h.addr.port))
    }

    /// A node of module (modid, cmdid) whose labels match `select`,
    /// `"key=value,key2=value2"` (every term a label of the node; at most
    /// 16 terms of 1 to 63 characters of A-Z a-z 0-9 . _ -): the agent
    /// chooses among the matching nodes with the module's policy, and when
    /// none matches falls back as its `lb.label_fallback` says. "" matches
    /// every node. Nodes get labels with the route (`lbagent route add
    /// --label`). Raises BadArgument for a selector out of bounds.
    #[pyo3(signature = (modid, cmdid, select, timeout=1.0))]
    fn get_host_selecting(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        select: &str,
        timeout: f64,
    ) -> PyResult<(String, u16)> {
        let selector: lbagent_model::Selector = select
            .parse()
            .map_err(|e| BadArgument::new_err(format!("selector: {e}")))?;
        let t = self::timeout(py, timeout)?;
        let h = self.with(py, true, |c| {
            c.get_host_selecting(modid, cmdid, &selector, t)
        })?;
        Ok((h.addr.ipv4().to_string(), h.addr.port))
    }

    /// The user priority (1..=128) this client gives `user_id` now, as
    /// get_host(user_id=...) sends it.
    fn user_priority(&self, py: Python<'_>, user_id: UserId) -> PyResult<u8> {
        self.with(py, false, |c| Ok(c.user_priority(user_id.bytes())))
    }

    /// Reports a call to `host` (an `(ip, port)`): retcode 0 is success.
    /// `downstream_level`: the `(B, U)` level the downstream attached to
    /// its response (each 1..=128), passed on to the agent; None for none.
    #[pyo3(signature = (modid, cmdid, host, retcode=0, tcost_ms=0, downstream_level=None))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        host: (String, u16),
        retcode: i32,
        tcost_ms: u32,
        downstream_level: Option<(u8, u8)>,
    ) -> PyResult<()> {
        let addr = node(py, host)?;
        let l = level_arg(py, downstream_level, "downstream_level")?;
        self.with(py, false, |c| {
            c.report_with_level(modid, cmdid, addr, retcode, tcost_ms, l)
        })
    }

    /// Asks the agent to pull the module; returns the route's version.
    #[pyo3(signature = (modid, cmdid, timeout=1.0))]
    fn register(&self, py: Python<'_>, modid: u32, cmdid: u32, timeout: f64) -> PyResult<u64> {
        let t = self::timeout(py, timeout)?;
        self.with(py, true, |c| c.register(modid, cmdid, t))
    }

    /// The agent's view of the module: one dict per node.
    #[pyo3(signature = (modid, cmdid, timeout=1.0))]
    fn get_route<'py>(
        &self,
        py: Python<'py>,
        modid: u32,
        cmdid: u32,
        timeout: f64,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let t = self::timeout(py, timeout)?;
        let view = self.with(py, true, |c| c.get_route(modid, cmdid, t))?;
        let mut out = Vec::with_capacity(view.nodes.len());
        for n in &view.nodes {
            let d = PyDict::new(py);
            d.set_item("ip", n.addr.ipv4().to_string())?;
            d.set_item("port", n.addr.port)?;
            d.set_item("weight", n.weight)?;
            d.set_item("overloaded", n.overloaded)?;
            d.set_item("vsucc", n.vsucc)?;
            d.set_item("verr", n.verr)?;
            d.set_item("rsucc", n.rsucc)?;
            d.set_item("rerr", n.rerr)?;
            d.set_item("contin_succ", n.contin_succ)?;
            d.set_item("contin_err", n.contin_err)?;
            d.set_item("version", view.version)?;
            out.push(d);
        }
        Ok(out)
    }

    /// Sends the successes the route cache holds.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, false, RustClient::flush)
    }
}

/// The native half of the `lbagent` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Client>()?;
    m.add_function(wrap_pyfunction!(encode_level, m)?)?;
    m.add_function(wrap_pyfunction!(decode_level, m)?)?;
    m.add("LbError", py.get_type::<LbError>())?;
    m.add("NoSuchModule", py.get_type::<NoSuchModule>())?;
    m.add("Overloaded", py.get_type::<Overloaded>())?;
    m.add("Rejected", py.get_type::<Rejected>())?;
    m.add("AgentDown", py.get_type::<AgentDown>())?;
    m.add("StaticRoutes", py.get_type::<StaticRoutes>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("BadResponse", py.get_type::<BadResponse>())?;
    m.add("BadArgument", py.get_type::<BadArgument>())?;
    Ok(())
}
