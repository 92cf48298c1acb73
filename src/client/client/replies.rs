//! What an answer means: each reply of the agent into a value, a typed
//! error, or a sign that the agent did not answer.

use super::*;

/// A cache route answer as `(version, unchanged, any_overloaded, nodes)`.
pub(super) type CacheAnswer = (u64, bool, bool, Vec<RouteNode>);

/// One part of an answer split across datagrams.
pub(super) struct Part<P> {
    pub(super) version: u64,
    pub(super) part: u32,
    pub(super) parts: u32,
    pub(super) body: P,
}

/// How often a split answer is asked again from part 0 because the route
/// changed between its parts.
pub(super) const PART_RESTARTS: u32 = 3;

pub(super) fn cache_route_reply(
    module: ModuleId,
    r: fb::CacheGetRouteResp<'_>,
) -> Reply<Part<CacheAnswer>> {
    if let Some(e) = other_module(module, r.modid(), r.cmdid(), "CacheGetRouteResp") {
        return Reply::Done(Err(e));
    }
    if r.retcode() != RetCode::Ok {
        return retcode_reply(module, r.retcode(), "");
    }
    let nodes: Vec<RouteNode> = r
        .nodes()
        .map(|v| v.iter().map(RouteNode::from).collect())
        .unwrap_or_default();
    if let Some(n) = nodes.iter().find(|n| n.addr.port == 0) {
        return Reply::Done(Err(ClientError::BadResponse(format!(
            "CacheGetRouteResp for module {module} names node {} with port 0",
            n.addr
        ))));
    }
    Reply::Done(Ok(Part {
        version: r.version(),
        part: r.part(),
        parts: r.parts().max(1),
        body: (r.version(), r.unchanged(), r.any_overloaded(), nodes),
    }))
}

/// What a getHost's answer means, whichever layout carried it; `level`
/// gets the admission level it carries.
pub(super) fn host_reply(
    module: ModuleId,
    a: &HostAnswer,
    level: &mut Option<Option<AdmissionLevel>>,
) -> Reply<NodeAddr> {
    if let Some(e) = other_module(module, a.module.modid, a.module.cmdid, "GetHostResp") {
        return Reply::Done(Err(e));
    }
    *level = Some(a.level);
    match (a.retcode, a.host) {
        (RetCode::Ok, Some(h)) if h.port != 0 => Reply::Done(Ok(h)),
        (RetCode::Ok, h) => Reply::Done(Err(ClientError::BadResponse(format!(
            "GetHostResp for module {module} says Ok but names {}",
            h.map_or("no host".to_string(), |h| h.to_string())
        )))),
        (rc, _) => retcode_reply(module, rc, ""),
    }
}

/// An answer reader for the requests whose answers are FlatBuffers only:
/// a getHost answer record to one of them is a bad response.
pub(super) fn flat<T>(
    mut f: impl FnMut(Message<'_>) -> Reply<T>,
) -> impl FnMut(Answer<'_>) -> Reply<T> {
    move |a| match a {
        Answer::Msg(m) => f(m),
        Answer::Host(_) => Reply::Done(Err(ClientError::BadResponse(
            "a getHost answer record where another answer was expected".into(),
        ))),
    }
}

/// The error for an answer about another module than the one asked.
pub(super) fn other_module(
    module: ModuleId,
    modid: u32,
    cmdid: u32,
    what: &str,
) -> Option<ClientError> {
    let got = ModuleId::new(modid, cmdid);
    (got != module).then(|| {
        ClientError::BadResponse(format!(
            "{what} is about module {got}, the request was about {module}"
        ))
    })
}

/// What an ErrorResp, or an answer of the wrong kind, means.
pub(super) fn other_reply<T>(module: ModuleId, msg: Message<'_>, request: &str) -> Reply<T> {
    match msg {
        Message::ErrorResp(r) => {
            if let Some(e) = other_module(module, r.modid(), r.cmdid(), "ErrorResp") {
                return Reply::Done(Err(e));
            }
            retcode_reply(module, r.retcode(), r.message().unwrap_or(""))
        }
        other => Reply::Done(Err(ClientError::BadResponse(format!(
            "a {} answering a {request}",
            other.name()
        )))),
    }
}

/// What a non-Ok retcode means; `message` is the agent's, if any.
pub(super) fn retcode_reply<T>(module: ModuleId, rc: RetCode, message: &str) -> Reply<T> {
    let e = match rc {
        RetCode::NoSuchModule => ClientError::NoSuchModule { module },
        RetCode::Overloaded => ClientError::Overloaded { module },
        RetCode::Rejected => ClientError::Rejected { module },
        RetCode::WrongShard => return Reply::WrongShard(message.to_string()),
        RetCode::BadRequest => ClientError::BadRequest(format!(
            "the agent refused the request for module {module}: {}",
            if message.is_empty() {
                "no reason given"
            } else {
                message
            }
        )),
        RetCode::Unavailable => ClientError::AgentDown(format!(
            "the agent cannot serve now (shutting down?): {message}"
        )),
        other => ClientError::BadResponse(format!(
            "retcode {} ({}) where it makes no sense, for module {module}",
            other.0,
            other.variant_name().unwrap_or("unknown")
        )),
    };
    Reply::Done(Err(e))
}

/// A timeout under 1 ms cannot be waited for.
#[inline(always)]
pub(super) fn check_timeout(timeout: Duration) -> Result<(), ClientError> {
    // As one word (0: under 1 ms): fewer instructions than the two tests.
    if (timeout.as_secs() | u64::from(timeout.subsec_nanos() >= 1_000_000)) == 0 {
        return Err(bad_timeout(timeout));
    }
    Ok(())
}

// The errors of the inlined paths, out of line.

#[cold]
#[inline(never)]
pub(super) fn bad_consumed(consumed: u32) -> ClientError {
    ClientError::BadRequest(format!(
        "consumed {consumed} units is out of range: at most {}",
        lbagent_wire::MAX_CONSUMED
    ))
}

#[cold]
#[inline(never)]
pub(super) fn bad_timeout(timeout: Duration) -> ClientError {
    ClientError::BadRequest(format!(
        "timeout {timeout:?} is under 1 ms: give the agent time to answer (e.g. 100 ms)"
    ))
}

#[cold]
#[inline(never)]
pub(super) fn bad_level(l: AdmissionLevel) -> ClientError {
    ClientError::BadRequest(format!(
        "downstream level ({}, {}) is out of range: each part is 1..=128",
        l.business, l.user
    ))
}

#[cold]
#[inline(never)]
pub(super) fn bad_host(host: NodeAddr) -> ClientError {
    ClientError::BadRequest(format!(
        "cannot report a call to {host}: port 0 names no node (report the host getHost returned)"
    ))
}
