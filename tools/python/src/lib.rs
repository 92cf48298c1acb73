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

use lbagent::client::{Client as RustClient, ClientError, ClientOptions, HostSource};
use lbagent::model::NodeAddr;
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
    let code = lbagent::client::tools::exit_code(&e);
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

/// A client of the local agent: `Client(heartbeat=None, cache=False,
/// snapshot=None)`.
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

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (heartbeat=None, cache=false, snapshot=None))]
    fn new(
        py: Python<'_>,
        heartbeat: Option<PathBuf>,
        cache: bool,
        snapshot: Option<PathBuf>,
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
        let c = RustClient::with_options(o).map_err(|e| to_py(py, e))?;
        Ok(Client {
            inner: Mutex::new(c),
        })
    }

    /// A node of module (modid, cmdid) as `(ip, port)`.
    #[pyo3(signature = (modid, cmdid, timeout=1.0, business_priority=0, user_priority=0))]
    fn get_host(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        timeout: f64,
        business_priority: u8,
        user_priority: u8,
    ) -> PyResult<(String, u16)> {
        let t = self::timeout(py, timeout)?;
        let addr = self.with(py, true, |c| {
            let o = c.options();
            if (o.business_priority, o.user_priority) != (business_priority, user_priority) {
                c.set_priorities(business_priority, user_priority)?;
            }
            c.get_host(modid, cmdid, t).map(|h| h.addr)
        })?;
        Ok((addr.ipv4().to_string(), addr.port))
    }

    /// Like get_host, plus where the node came from: `(ip, port, source)`
    /// with source "agent", "cache" or "static_routes".
    #[pyo3(signature = (modid, cmdid, timeout=1.0))]
    fn get_host_source(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        timeout: f64,
    ) -> PyResult<(String, u16, &'static str)> {
        let t = self::timeout(py, timeout)?;
        let h = self.with(py, true, |c| c.get_host(modid, cmdid, t))?;
        let source = match h.source {
            HostSource::Agent => "agent",
            HostSource::Cache => "cache",
            HostSource::StaticRoutes => "static_routes",
        };
        Ok((h.addr.ipv4().to_string(), h.addr.port, source))
    }

    /// Reports a call to `host` (an `(ip, port)`): retcode 0 is success.
    #[pyo3(signature = (modid, cmdid, host, retcode=0, tcost_ms=0))]
    fn report(
        &self,
        py: Python<'_>,
        modid: u32,
        cmdid: u32,
        host: (String, u16),
        retcode: i32,
        tcost_ms: u32,
    ) -> PyResult<()> {
        let addr = node(py, host)?;
        self.with(py, false, |c| {
            c.report(modid, cmdid, addr, retcode, tcost_ms)
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
