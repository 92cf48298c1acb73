//! register and getRoute on [`Client`]: a whole module's route, asked in
//! parts when it does not fit one datagram.

use super::*;

impl Client {
    /// Asks the agent to pull module `(modid, cmdid)` before first use and
    /// waits (at most `timeout`) until its route is there; returns the
    /// route's version. The agent is told to give up a little before
    /// `timeout` (9/10 of it, at most 60 s) so that its answer arrives in
    /// time.
    ///
    /// # Errors
    /// [`ClientError::NoSuchModule`] when the route server does not know the
    /// module, [`ClientError::Timeout`] when the route did not arrive in
    /// time (or the agent did not answer), [`ClientError::AgentDown`],
    /// [`ClientError::BadResponse`], [`ClientError::BadRequest`] (a timeout
    /// under 1 ms).
    pub fn register(
        &mut self,
        modid: u32,
        cmdid: u32,
        timeout: Duration,
    ) -> Result<u64, ClientError> {
        let module = ModuleId::new(modid, cmdid);
        check_timeout(timeout)?;
        let due = Due::after(timeout);
        self.locate().map_err(ClientError::AgentDown)?;
        let agent_wait =
            (timeout.as_millis() * 9 / 10).clamp(1, u128::from(MAX_REGISTER_TIMEOUT_MS));
        let agent_wait = agent_wait as u32;
        let r = self.exchange(
            module,
            &due,
            None,
            |e, seq| {
                e.register_req(seq, module, agent_wait);
            },
            flat(|msg| match msg {
                Message::RegisterResp(r) => {
                    if let Some(e) = other_module(module, r.modid(), r.cmdid(), "RegisterResp") {
                        return Reply::Done(Err(e));
                    }
                    match r.retcode() {
                        RetCode::Ok => Reply::Done(Ok(r.version())),
                        RetCode::Timeout => Reply::Done(Err(ClientError::Timeout {
                            module,
                            waited: due.elapsed(),
                        })),
                        rc => retcode_reply(module, rc, ""),
                    }
                }
                other => other_reply(module, other, "RegisterReq"),
            }),
        );
        r.map_err(|t| self.not_answered(module, &due, t))
    }

    /// The agent's view of module `(modid, cmdid)`: its route version and
    /// every node with its state and counters (what `lbagent getroute`
    /// prints). Waits at most `timeout`.
    ///
    /// # Errors
    /// [`ClientError::NoSuchModule`] when the agent has no route for it,
    /// [`ClientError::AgentDown`], [`ClientError::Timeout`],
    /// [`ClientError::BadResponse`], [`ClientError::BadRequest`] (a timeout
    /// under 1 ms).
    pub fn get_route(
        &mut self,
        modid: u32,
        cmdid: u32,
        timeout: Duration,
    ) -> Result<RouteView, ClientError> {
        let module = ModuleId::new(modid, cmdid);
        check_timeout(timeout)?;
        let due = Due::after(timeout);
        self.locate().map_err(ClientError::AgentDown)?;
        let r = self.exchange_parts(
            module,
            &due,
            |e, seq, part| {
                e.get_route_req_part(seq, module, part);
            },
            |msg| match msg {
                Message::GetRouteResp(r) => {
                    if let Some(e) = other_module(module, r.modid(), r.cmdid(), "GetRouteResp") {
                        return Reply::Done(Err(e));
                    }
                    match r.retcode() {
                        RetCode::Ok => {
                            let nodes: Vec<NodeStatus> = r
                                .nodes()
                                .map(|v| v.iter().map(NodeStatus::from).collect())
                                .unwrap_or_default();
                            let policy = Policy::from_code(r.policy()).unwrap_or_default();
                            Reply::Done(Ok(Part {
                                version: r.version(),
                                part: r.part(),
                                parts: r.parts().max(1),
                                body: (policy, nodes),
                            }))
                        }
                        rc => retcode_reply(module, rc, ""),
                    }
                }
                other => other_reply(module, other, "GetRouteReq"),
            },
        );
        match r {
            Ok((version, parts)) => Ok(RouteView {
                module,
                version,
                policy: parts.first().map_or(Policy::L5, |p| p.0),
                nodes: parts.into_iter().flat_map(|p| p.1).collect(),
            }),
            Err(t) => Err(self.not_answered(module, &due, t)),
        }
    }

    /// Asks for every part of an answer the agent splits across datagrams
    /// (a module too large for one): part 0 says how many there are, then
    /// each further part is its own exchange, all within the call's
    /// deadline (`due`). Every part must carry part 0's version and part
    /// count; when the route changes between parts the whole answer is
    /// asked again (at most [`PART_RESTARTS`] times). Returns the version
    /// and the parts' bodies in order.
    pub(super) fn exchange_parts<P>(
        &mut self,
        module: ModuleId,
        due: &Due,
        build: impl Fn(&mut Encoder, u32, u32),
        answer: impl Fn(Message<'_>) -> Reply<Part<P>>,
    ) -> Result<(u64, Vec<P>), Trouble> {
        let mut restarts = 0;
        'whole: loop {
            let first =
                self.exchange(module, due, None, |e, seq| build(e, seq, 0), flat(&answer))?;
            let (version, parts) = (first.version, first.parts);
            if parts > lbagent_wire::MAX_ROUTE_PARTS || first.part != 0 {
                return Err(Trouble::Error(ClientError::BadResponse(format!(
                    "the route of module {module} comes as part {} of {parts}: at most {} parts are accepted",
                    first.part,
                    lbagent_wire::MAX_ROUTE_PARTS
                ))));
            }
            let mut bodies = Vec::with_capacity(parts as usize);
            bodies.push(first.body);
            for k in 1..parts {
                let next = match self.exchange(
                    module,
                    due,
                    None,
                    |e, seq| build(e, seq, k),
                    flat(&answer),
                ) {
                    Ok(p) => p,
                    // The route shrank between parts: this part is gone.
                    Err(Trouble::Error(ClientError::BadRequest(_))) if restarts < PART_RESTARTS => {
                        restarts += 1;
                        continue 'whole;
                    }
                    Err(Trouble::Unreachable { why, timed_out }) => {
                        return Err(Trouble::Unreachable {
                            why: format!(
                                "{why} (after {k} of {parts} parts of the route of module {module})"
                            ),
                            timed_out,
                        })
                    }
                    Err(t) => return Err(t),
                };
                if next.version != version || next.parts != parts || next.part != k {
                    if restarts < PART_RESTARTS {
                        restarts += 1;
                        continue 'whole;
                    }
                    return Err(Trouble::Error(ClientError::BadResponse(format!(
                        "the route of module {module} kept changing while its {parts} parts were read"
                    ))));
                }
                bodies.push(next.body);
            }
            return Ok((version, bodies));
        }
    }
}
