//! Encoding: plain values in, one finished buffer out, built in a
//! FlatBufferBuilder that is reset and reused, so that after warm-up
//! encoding allocates nothing.

use flatbuffers::{FlatBufferBuilder, Push, UOffsetT, Vector, WIPOffset};

use super::fb;
use super::values::{CacheRoute, ModuleStats, NodeStats, NodeStatus, Report};
use super::{AdmissionLevel, RetCode};
use lbagent_model::{ModuleId, ModuleOptions, NodeAddr, NodeMeta, Policy, RouteNode};

/// Encodes messages into one reusable buffer.
///
/// Each method resets the builder, encodes one message in an `Envelope`
/// finished with the file identifier, and returns the bytes, valid until the
/// next call. The buffer grows to the largest message encoded and stays
/// there. Nothing here checks a transport's limit: a datagram longer than
/// [`super::Limits::UDP`] allows (a GetRouteResp of a huge module) is the
/// caller's to refuse.
#[derive(Debug)]
pub struct Encoder {
    fbb: FlatBufferBuilder<'static>,
    /// Offsets of the tables of a vector under construction (scratch).
    offsets: Vec<UOffsetT>,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Encoder {
    /// An encoder whose buffer starts at 1 KiB (a getHost exchange needs
    /// under 100 bytes).
    pub fn new() -> Self {
        Self::with_capacity(1024)
    }

    /// An encoder whose buffer starts at `bytes`.
    pub fn with_capacity(bytes: usize) -> Self {
        Encoder {
            fbb: FlatBufferBuilder::with_capacity(bytes),
            offsets: Vec::new(),
        }
    }

    /// The buffer the last encoding method finished, again. Call it only
    /// after an encoding method (it panics otherwise, as
    /// `FlatBufferBuilder::finished_data` does).
    pub fn finished(&self) -> &[u8] {
        self.fbb.finished_data()
    }

    /// Wraps `body` in an Envelope and finishes the buffer.
    fn finish<T>(&mut self, body_type: fb::Body, body: WIPOffset<T>) -> &[u8] {
        let envelope = fb::Envelope::create(
            &mut self.fbb,
            &fb::EnvelopeArgs {
                body_type,
                body: Some(body.as_union_value()),
            },
        );
        fb::finish_envelope_buffer(&mut self.fbb, envelope);
        self.fbb.finished_data()
    }

    /// A vector of structs converted from `items`; `None` when empty (an
    /// absent vector reads as empty and costs nothing).
    fn structs<S: Copy, T: Push>(
        &mut self,
        items: &[S],
        to_wire: impl Fn(S) -> T,
    ) -> Option<WIPOffset<Vector<'static, T::Output>>> {
        (!items.is_empty()).then(|| {
            self.fbb
                .create_vector_from_iter(items.iter().map(|&i| to_wire(i)))
        })
    }

    /// The vector of the tables whose offsets are in `self.offsets`.
    fn tables<T>(&mut self) -> Option<WIPOffset<Vector<'static, flatbuffers::ForwardsUOffset<T>>>> {
        let offsets = self.offsets.iter().map(|&o| WIPOffset::<T>::new(o));
        (!self.offsets.is_empty()).then(|| self.fbb.create_vector_from_iter(offsets))
    }

    /// GetHostReq: ask for one node of `module`, with DAGOR priorities
    /// (0 = unset, else 1..=128).
    pub fn get_host_req(
        &mut self,
        seq: u32,
        module: ModuleId,
        business_priority: u8,
        user_priority: u8,
    ) -> &[u8] {
        self.get_host_req_keyed(seq, module, business_priority, user_priority, None)
    }

    /// GetHostReq as [`Encoder::get_host_req`], with the hash of the
    /// caller's key when it has one (consistent hashing;
    /// [`lbagent_model::key_hash`]).
    pub fn get_host_req_keyed(
        &mut self,
        seq: u32,
        module: ModuleId,
        business_priority: u8,
        user_priority: u8,
        key_hash: Option<u64>,
    ) -> &[u8] {
        self.get_host_req_full(seq, module, business_priority, user_priority, key_hash, "")
    }

    /// GetHostReq with every optional part: a key's hash and a label
    /// selector (`k=v,k2=v2`; empty: none, the field is left out).
    pub fn get_host_req_full(
        &mut self,
        seq: u32,
        module: ModuleId,
        business_priority: u8,
        user_priority: u8,
        key_hash: Option<u64>,
        selector: &str,
    ) -> &[u8] {
        self.fbb.reset();
        let selector = (!selector.is_empty()).then(|| self.fbb.create_string(selector));
        let args = fb::GetHostReqArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            business_priority,
            user_priority,
            key_hash,
            selector,
        };
        let body = fb::GetHostReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::GetHostReq, body)
    }

    /// GetHostResp: `host` is set only when `retcode` is Ok; `admission_level`
    /// when admission control is on.
    pub fn get_host_resp(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        host: Option<NodeAddr>,
        admission_level: Option<AdmissionLevel>,
    ) -> &[u8] {
        self.fbb.reset();
        let host = host.map(fb::Host::from);
        let level = admission_level.map(fb::AdmissionLevel::from);
        let args = fb::GetHostRespArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            retcode,
            host: host.as_ref(),
            admission_level: level.as_ref(),
        };
        let body = fb::GetHostResp::create(&mut self.fbb, &args);
        self.finish(fb::Body::GetHostResp, body)
    }

    /// ReportReq: the result of one call.
    pub fn report_req(&mut self, report: &Report) -> &[u8] {
        self.fbb.reset();
        let host = fb::Host::from(report.host);
        let level = report.downstream_level.map(fb::AdmissionLevel::from);
        let args = fb::ReportReqArgs {
            seq: report.seq,
            modid: report.module.modid,
            cmdid: report.module.cmdid,
            host: Some(&host),
            retcode: report.retcode,
            tcost_ms: report.tcost_ms,
            downstream_level: level.as_ref(),
            consumed: report.consumed,
        };
        let body = fb::ReportReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::ReportReq, body)
    }

    /// BatchReportReq: `(node, successful calls)` pairs held by a route cache.
    pub fn batch_report_req(
        &mut self,
        seq: u32,
        module: ModuleId,
        successes: &[(NodeAddr, u32)],
    ) -> &[u8] {
        self.fbb.reset();
        let successes = self.structs(successes, |(addr, count)| {
            fb::HostCount::new(&addr.into(), count)
        });
        let args = fb::BatchReportReqArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            successes,
        };
        let body = fb::BatchReportReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::BatchReportReq, body)
    }

    /// RegisterReq: pull `module` and wait at most `timeout_ms` for it.
    pub fn register_req(&mut self, seq: u32, module: ModuleId, timeout_ms: u32) -> &[u8] {
        self.fbb.reset();
        let args = fb::RegisterReqArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            timeout_ms,
        };
        let body = fb::RegisterReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::RegisterReq, body)
    }

    /// RegisterResp: Ok (route present, at `version`), NoSuchModule or Timeout.
    pub fn register_resp(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        version: u64,
    ) -> &[u8] {
        self.fbb.reset();
        let args = fb::RegisterRespArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            retcode,
            version,
        };
        let body = fb::RegisterResp::create(&mut self.fbb, &args);
        self.finish(fb::Body::RegisterResp, body)
    }

    /// GetRouteReq: ask for the agent's view of `module` (its first part).
    pub fn get_route_req(&mut self, seq: u32, module: ModuleId) -> &[u8] {
        self.get_route_req_part(seq, module, 0)
    }

    /// GetRouteReq for part `part` of an answer split across datagrams.
    pub fn get_route_req_part(&mut self, seq: u32, module: ModuleId, part: u32) -> &[u8] {
        self.fbb.reset();
        let args = fb::GetRouteReqArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            part,
        };
        let body = fb::GetRouteReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::GetRouteReq, body)
    }

    /// GetRouteResp: every node of `module` with its state and counters,
    /// in one datagram.
    pub fn get_route_resp(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        version: u64,
        nodes: &[NodeStatus],
    ) -> &[u8] {
        let none = ModuleOptions::default();
        self.get_route_resp_part(
            seq,
            module,
            retcode,
            version,
            nodes,
            (0, 1),
            Policy::L5,
            &none,
        )
    }

    /// GetRouteResp carrying `nodes`, part `part.0` of `part.1`, of a
    /// module of `policy` with its own `options`.
    #[allow(clippy::too_many_arguments)]
    pub fn get_route_resp_part(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        version: u64,
        nodes: &[NodeStatus],
        part: (u32, u32),
        policy: Policy,
        options: &ModuleOptions,
    ) -> &[u8] {
        self.fbb.reset();
        self.offsets.clear();
        for n in nodes {
            let host = fb::Host::from(n.addr);
            let args = fb::NodeStatusArgs {
                host: Some(&host),
                weight: n.weight,
                overloaded: n.overloaded,
                vsucc: n.vsucc,
                verr: n.verr,
                rsucc: n.rsucc,
                rerr: n.rerr,
                contin_succ: n.contin_succ,
                contin_err: n.contin_err,
                bad_windows: n.bad_windows,
                window_age_ms: n.window_age_ms,
                overload_age_ms: n.overload_age_ms,
                capacity: n.capacity,
                in_use: n.in_use,
                phi: n.phi,
            };
            let node = fb::NodeStatus::create(&mut self.fbb, &args);
            self.offsets.push(node.value());
        }
        let nodes = self.tables::<fb::NodeStatus>();
        let options = self.module_options(options);
        let args = fb::GetRouteRespArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            retcode,
            version,
            nodes,
            part: part.0,
            parts: part.1,
            policy: policy.code(),
            options,
        };
        let body = fb::GetRouteResp::create(&mut self.fbb, &args);
        self.finish(fb::Body::GetRouteResp, body)
    }

    /// CacheGetRouteReq: ask for `module`'s route, holding `known_version`
    /// (0 = none).
    pub fn cache_get_route_req(&mut self, seq: u32, module: ModuleId, known_version: u64) -> &[u8] {
        self.cache_get_route_req_part(seq, module, known_version, 0)
    }

    /// CacheGetRouteReq for part `part` of an answer split across datagrams.
    pub fn cache_get_route_req_part(
        &mut self,
        seq: u32,
        module: ModuleId,
        known_version: u64,
        part: u32,
    ) -> &[u8] {
        self.fbb.reset();
        let args = fb::CacheGetRouteReqArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            known_version,
            part,
        };
        let body = fb::CacheGetRouteReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::CacheGetRouteReq, body)
    }

    /// CacheGetRouteResp: the route for a route cache, in one datagram.
    pub fn cache_get_route_resp(&mut self, resp: &CacheRoute<'_>) -> &[u8] {
        self.cache_get_route_resp_part(resp, (0, 1))
    }

    /// CacheGetRouteResp carrying `resp.nodes` as part `part.0` of `part.1`.
    pub fn cache_get_route_resp_part(&mut self, resp: &CacheRoute<'_>, part: (u32, u32)) -> &[u8] {
        self.fbb.reset();
        let nodes = self.structs(resp.nodes, fb::RouteNode::from);
        let args = fb::CacheGetRouteRespArgs {
            seq: resp.seq,
            modid: resp.module.modid,
            cmdid: resp.module.cmdid,
            retcode: resp.retcode,
            version: resp.version,
            unchanged: resp.unchanged,
            any_overloaded: resp.any_overloaded,
            nodes,
            part: part.0,
            parts: part.1,
        };
        let body = fb::CacheGetRouteResp::create(&mut self.fbb, &args);
        self.finish(fb::Body::CacheGetRouteResp, body)
    }

    /// ErrorResp: a refused request, `message` naming what was wrong.
    pub fn error_resp(
        &mut self,
        seq: u64,
        module: ModuleId,
        retcode: RetCode,
        message: &str,
    ) -> &[u8] {
        self.fbb.reset();
        let message = self.fbb.create_string(message);
        let args = fb::ErrorRespArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            retcode,
            message: Some(message),
        };
        let body = fb::ErrorResp::create(&mut self.fbb, &args);
        self.finish(fb::Body::ErrorResp, body)
    }

    /// PullReq: ask the route server for `modules` and subscribe to them.
    pub fn pull_req(&mut self, seq: u64, modules: &[ModuleId]) -> &[u8] {
        self.fbb.reset();
        let modules = self.structs(modules, fb::ModuleId::from);
        let args = fb::PullReqArgs {
            seq,
            modules,
            known_versions: None,
        };
        let body = fb::PullReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::PullReq, body)
    }

    /// PullReq carrying the version the agent holds of each module
    /// (`known_versions[i]` for `modules[i]`, 0: none): a route server that
    /// reads the field answers the unchanged ones with one RouteUnchanged.
    ///
    /// # Panics
    /// When the two slices differ in length (a caller bug).
    pub fn pull_req_known(
        &mut self,
        seq: u64,
        modules: &[ModuleId],
        known_versions: &[u64],
    ) -> &[u8] {
        assert_eq!(
            modules.len(),
            known_versions.len(),
            "one version per module"
        );
        self.fbb.reset();
        let modules = self.structs(modules, fb::ModuleId::from);
        let known_versions = Some(self.fbb.create_vector(known_versions));
        let args = fb::PullReqArgs {
            seq,
            modules,
            known_versions,
        };
        let body = fb::PullReq::create(&mut self.fbb, &args);
        self.finish(fb::Body::PullReq, body)
    }

    /// RouteUnchanged: the modules of PullReq `seq` still at the versions
    /// the agent holds (`versions[i]` for `modules[i]`).
    ///
    /// # Panics
    /// When the two slices differ in length (a caller bug).
    pub fn route_unchanged(&mut self, seq: u64, modules: &[ModuleId], versions: &[u64]) -> &[u8] {
        assert_eq!(modules.len(), versions.len(), "one version per module");
        self.fbb.reset();
        let modules = self.structs(modules, fb::ModuleId::from);
        let versions = Some(self.fbb.create_vector(versions));
        let args = fb::RouteUnchangedArgs {
            seq,
            modules,
            versions,
        };
        let body = fb::RouteUnchanged::create(&mut self.fbb, &args);
        self.finish(fb::Body::RouteUnchanged, body)
    }

    /// Unsubscribe: the agent no longer follows `modules` (at most
    /// [`super::MAX_PULL_MODULES`] per frame, as a PullReq).
    pub fn unsubscribe(&mut self, modules: &[ModuleId]) -> &[u8] {
        self.fbb.reset();
        let modules = self.structs(modules, fb::ModuleId::from);
        let body = fb::Unsubscribe::create(&mut self.fbb, &fb::UnsubscribeArgs { modules });
        self.finish(fb::Body::Unsubscribe, body)
    }

    /// RouteAnswer: `module`'s route for PullReq `seq` (`exists` false and no
    /// nodes when the route server has no such module).
    pub fn route_answer(
        &mut self,
        seq: u64,
        module: ModuleId,
        exists: bool,
        version: u64,
        nodes: &[RouteNode],
    ) -> &[u8] {
        let none = ModuleOptions::default();
        self.route_answer_meta(seq, module, exists, version, nodes, Policy::L5, &none, &[])
    }

    /// RouteAnswer of a module of `policy` with its own `options`, whose
    /// nodes `meta` names have a zone or labels (issue 31; nodes with
    /// neither are left out).
    #[allow(clippy::too_many_arguments)]
    pub fn route_answer_meta(
        &mut self,
        seq: u64,
        module: ModuleId,
        exists: bool,
        version: u64,
        nodes: &[RouteNode],
        policy: Policy,
        options: &ModuleOptions,
        meta: &[(NodeAddr, NodeMeta)],
    ) -> &[u8] {
        self.fbb.reset();
        let nodes = self.structs(nodes, fb::RouteNode::from);
        let options = self.module_options(options);
        let node_meta = crate::meta::build(&mut self.fbb, meta);
        let args = fb::RouteAnswerArgs {
            seq,
            modid: module.modid,
            cmdid: module.cmdid,
            exists,
            version,
            nodes,
            policy: policy.code(),
            options,
            node_meta,
        };
        let body = fb::RouteAnswer::create(&mut self.fbb, &args);
        self.finish(fb::Body::RouteAnswer, body)
    }

    /// RoutePush: `module` changed (`exists` false: it was deleted).
    pub fn route_push(
        &mut self,
        module: ModuleId,
        exists: bool,
        version: u64,
        nodes: &[RouteNode],
    ) -> &[u8] {
        let none = ModuleOptions::default();
        self.route_push_meta(module, exists, version, nodes, Policy::L5, &none, &[])
    }

    /// RoutePush of a module of `policy` with its own `options` and its
    /// nodes' zones and labels, as [`Encoder::route_answer_meta`].
    #[allow(clippy::too_many_arguments)]
    pub fn route_push_meta(
        &mut self,
        module: ModuleId,
        exists: bool,
        version: u64,
        nodes: &[RouteNode],
        policy: Policy,
        options: &ModuleOptions,
        meta: &[(NodeAddr, NodeMeta)],
    ) -> &[u8] {
        self.fbb.reset();
        let nodes = self.structs(nodes, fb::RouteNode::from);
        let options = self.module_options(options);
        let node_meta = crate::meta::build(&mut self.fbb, meta);
        let args = fb::RoutePushArgs {
            modid: module.modid,
            cmdid: module.cmdid,
            exists,
            version,
            nodes,
            policy: policy.code(),
            options,
            node_meta,
        };
        let body = fb::RoutePush::create(&mut self.fbb, &args);
        self.finish(fb::Body::RoutePush, body)
    }

    /// A module's own options as a table; None (nothing on the wire) when
    /// none is set.
    fn module_options(
        &mut self,
        o: &ModuleOptions,
    ) -> Option<WIPOffset<fb::ModuleOptions<'static>>> {
        if o.is_unset() {
            return None;
        }
        let args = fb::ModuleOptionsArgs {
            slow_start_ms: o.slow_start_ms,
            max_overloaded_percent: o.max_overloaded_percent,
            panic_percent: o.panic_percent,
            locality_min_percent: o.locality_min_percent,
        };
        Some(fb::ModuleOptions::create(&mut self.fbb, &args))
    }

    /// KeepAlive: keep this connection's subscriptions.
    pub fn keep_alive(&mut self, seq: u64) -> &[u8] {
        self.fbb.reset();
        let body = fb::KeepAlive::create(&mut self.fbb, &fb::KeepAliveArgs { seq });
        self.finish(fb::Body::KeepAlive, body)
    }

    /// KeepAliveAck: the answer to KeepAlive `seq`.
    pub fn keep_alive_ack(&mut self, seq: u64) -> &[u8] {
        self.fbb.reset();
        let body = fb::KeepAliveAck::create(&mut self.fbb, &fb::KeepAliveAckArgs { seq });
        self.finish(fb::Body::KeepAliveAck, body)
    }

    /// StatsReport: the per-node statistics of `modules`, taken at `time_s`
    /// (Unix seconds) by the agent at `caller` (IPv4, host byte order).
    pub fn stats_report(
        &mut self,
        seq: u64,
        caller: u32,
        time_s: u64,
        modules: &[ModuleStats<'_>],
    ) -> &[u8] {
        self.stats_report_of_run(seq, caller, time_s, 0, modules)
    }

    /// StatsReport of the agent run `agent_start` (its random start
    /// number, never 0 from an agent that sets it; 0 reads as an agent
    /// that predates the field): with `caller` and `seq` it names the
    /// report for good, so that a reporter applies a re-sent report's
    /// consumed units once.
    pub fn stats_report_of_run(
        &mut self,
        seq: u64,
        caller: u32,
        time_s: u64,
        agent_start: u64,
        modules: &[ModuleStats<'_>],
    ) -> &[u8] {
        self.fbb.reset();
        self.offsets.clear();
        for m in modules {
            let nodes = self.structs(m.nodes, |n: NodeStats| fb::NodeStats::from(n));
            let consumed = self.structs(m.consumed, |(addr, count)| {
                fb::HostCount::new(&addr.into(), count)
            });
            let args = fb::ModuleStatsArgs {
                modid: m.module.modid,
                cmdid: m.module.cmdid,
                nodes,
                consumed,
            };
            let module = fb::ModuleStats::create(&mut self.fbb, &args);
            self.offsets.push(module.value());
        }
        let modules = self.tables::<fb::ModuleStats>();
        let args = fb::StatsReportArgs {
            seq,
            caller,
            time_s,
            modules,
            agent_start,
        };
        let body = fb::StatsReport::create(&mut self.fbb, &args);
        self.finish(fb::Body::StatsReport, body)
    }

    /// StatsAck: StatsReport `seq` was accepted.
    pub fn stats_ack(&mut self, seq: u64) -> &[u8] {
        self.fbb.reset();
        let body = fb::StatsAck::create(&mut self.fbb, &fb::StatsAckArgs { seq });
        self.finish(fb::Body::StatsAck, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, Limits, Message};
    use std::net::Ipv4Addr;

    const M: ModuleId = ModuleId::new(10_001, 7);

    fn addr(last: u8, port: u16) -> NodeAddr {
        NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), port)
    }

    fn route() -> [RouteNode; 2] {
        [
            RouteNode {
                addr: addr(1, 9000),
                weight: 3,
            },
            RouteNode {
                addr: addr(2, 9001),
                weight: 0,
            },
        ]
    }

    fn plain(nodes: Option<Vector<'_, fb::RouteNode>>) -> Vec<RouteNode> {
        nodes
            .unwrap_or_default()
            .iter()
            .map(RouteNode::from)
            .collect()
    }

    /// Decodes `buf` as a TCP frame would be (the larger limits).
    fn decoded(buf: &[u8]) -> Message<'_> {
        decode(buf, &Limits::TCP_FRAME).expect("an encoded message decodes")
    }

    #[test]
    fn get_host_req_round_trips() {
        let mut enc = Encoder::new();
        let buf = enc.get_host_req(42, M, 3, 128);
        let Message::GetHostReq(m) = decoded(buf) else {
            panic!("wrong type")
        };
        let v = m.validate().unwrap();
        assert_eq!((v.seq, v.module), (42, M));
        assert_eq!((v.business_priority, v.user_priority), (3, 128));
        assert_eq!(m.key_hash(), None, "an unkeyed getHost carries no key");
    }

    #[test]
    fn a_keyed_get_host_req_carries_its_hash_and_is_left_to_the_full_decode() {
        let mut enc = Encoder::new();
        for hash in [0, 7, u64::MAX] {
            let buf = enc.get_host_req_keyed(1, M, 0, 0, Some(hash)).to_vec();
            let Message::GetHostReq(m) = decoded(&buf) else {
                panic!("wrong type")
            };
            assert_eq!(m.key_hash(), Some(hash));
            // The hot path's reader leaves it to the full decode.
            assert_eq!(crate::read_hot(&buf, &crate::Limits::UDP), None);
        }
        let plain = enc.get_host_req(1, M, 0, 0).to_vec();
        assert!(crate::read_hot(&plain, &crate::Limits::UDP).is_some());
    }

    #[test]
    fn get_host_resp_round_trips_with_and_without_optionals() {
        let mut enc = Encoder::new();
        let level = AdmissionLevel::new(5, 9);
        let buf = enc.get_host_resp(1, M, RetCode::Ok, Some(addr(1, 80)), Some(level));
        let Message::GetHostResp(m) = decoded(buf) else {
            panic!("wrong type")
        };
        assert_eq!(
            (m.seq(), m.modid(), m.cmdid(), m.retcode()),
            (1, M.modid, M.cmdid, RetCode::Ok)
        );
        assert_eq!(m.host().map(NodeAddr::from), Some(addr(1, 80)));
        assert_eq!(AdmissionLevel::from_wire(m.admission_level()), Some(level));

        let buf = enc.get_host_resp(2, M, RetCode::Overloaded, None, None);
        let Message::GetHostResp(m) = decoded(buf) else {
            panic!("wrong type")
        };
        assert_eq!(m.retcode(), RetCode::Overloaded);
        assert!(m.host().is_none() && m.admission_level().is_none());
    }

    #[test]
    fn report_req_round_trips() {
        let report = Report {
            seq: 9,
            module: M,
            host: addr(3, 7000),
            retcode: -1,
            tcost_ms: 250,
            downstream_level: Some(AdmissionLevel::new(1, 2)),
            consumed: 0,
        };
        let mut enc = Encoder::new();
        let Message::ReportReq(m) = decoded(enc.report_req(&report)) else {
            panic!("wrong type")
        };
        assert_eq!(m.validate(), Ok(report));
    }

    #[test]
    fn batch_report_req_round_trips() {
        let successes = [(addr(1, 1), 10), (addr(2, 2), 0), (addr(3, 3), u32::MAX)];
        let mut enc = Encoder::new();
        let Message::BatchReportReq(m) = decoded(enc.batch_report_req(5, M, &successes)) else {
            panic!("wrong type")
        };
        let v = m.validate().unwrap();
        assert_eq!((v.seq, v.module), (5, M));
        assert_eq!(v.successes().collect::<Vec<_>>(), successes);
    }

    #[test]
    fn register_req_and_resp_round_trip() {
        let mut enc = Encoder::new();
        let Message::RegisterReq(m) = decoded(enc.register_req(6, M, 1500)) else {
            panic!("wrong type")
        };
        let v = m.validate().unwrap();
        assert_eq!((v.seq, v.module, v.timeout_ms), (6, M, 1500));

        let Message::RegisterResp(m) = decoded(enc.register_resp(6, M, RetCode::Timeout, 77))
        else {
            panic!("wrong type")
        };
        assert_eq!((m.seq(), m.modid(), m.cmdid()), (6, M.modid, M.cmdid));
        assert_eq!((m.retcode(), m.version()), (RetCode::Timeout, 77));
    }

    #[test]
    fn get_route_req_and_resp_round_trip() {
        let mut enc = Encoder::new();
        let Message::GetRouteReq(m) = decoded(enc.get_route_req(8, M)) else {
            panic!("wrong type")
        };
        assert_eq!((m.seq(), m.modid(), m.cmdid()), (8, M.modid, M.cmdid));

        let nodes = [
            NodeStatus {
                addr: addr(1, 9000),
                weight: 2,
                overloaded: true,
                vsucc: 1,
                verr: 2,
                rsucc: 3,
                rerr: 4,
                contin_succ: 5,
                contin_err: 6,
                bad_windows: 7,
                window_age_ms: 8,
                overload_age_ms: u64::MAX,
                capacity: 0,
                in_use: 0,
                phi: 0.0,
            },
            NodeStatus {
                addr: addr(2, 9001),
                weight: 0,
                overloaded: false,
                vsucc: 180,
                verr: 0,
                rsucc: 0,
                rerr: 0,
                contin_succ: 0,
                contin_err: 0,
                bad_windows: 0,
                window_age_ms: 0,
                overload_age_ms: 0,
                capacity: 0,
                in_use: 0,
                phi: 0.0,
            },
        ];
        let buf = enc.get_route_resp(8, M, RetCode::Ok, 3, &nodes);
        let Message::GetRouteResp(m) = decoded(buf) else {
            panic!("wrong type")
        };
        assert_eq!((m.seq(), m.retcode(), m.version()), (8, RetCode::Ok, 3));
        let got: Vec<NodeStatus> = m.nodes().unwrap().iter().map(NodeStatus::from).collect();
        assert_eq!(got, nodes);
    }

    #[test]
    fn cache_get_route_req_and_resp_round_trip() {
        let mut enc = Encoder::new();
        let Message::CacheGetRouteReq(m) = decoded(enc.cache_get_route_req(4, M, 12)) else {
            panic!("wrong type")
        };
        assert_eq!(
            (m.seq(), m.modid(), m.cmdid(), m.known_version()),
            (4, M.modid, M.cmdid, 12)
        );

        let nodes = route();
        let resp = CacheRoute {
            seq: 4,
            module: M,
            retcode: RetCode::Ok,
            version: 13,
            unchanged: false,
            any_overloaded: true,
            nodes: &nodes,
        };
        let Message::CacheGetRouteResp(m) = decoded(enc.cache_get_route_resp(&resp)) else {
            panic!("wrong type")
        };
        assert_eq!(
            (m.seq(), m.modid(), m.cmdid(), m.retcode()),
            (4, M.modid, M.cmdid, RetCode::Ok)
        );
        assert_eq!(
            (m.version(), m.unchanged(), m.any_overloaded()),
            (13, false, true)
        );
        assert_eq!(plain(m.nodes()), nodes);
    }

    #[test]
    fn error_resp_round_trips() {
        let mut enc = Encoder::new();
        let buf = enc.error_resp(u64::MAX, M, RetCode::WrongShard, "owner is shard 1");
        let Message::ErrorResp(m) = decoded(buf) else {
            panic!("wrong type")
        };
        assert_eq!(
            (m.seq(), m.modid(), m.cmdid()),
            (u64::MAX, M.modid, M.cmdid)
        );
        assert_eq!(
            (m.retcode(), m.message()),
            (RetCode::WrongShard, Some("owner is shard 1"))
        );
    }

    #[test]
    fn pull_req_round_trips() {
        let modules = [M, ModuleId::new(1, 2), ModuleId::new(u32::MAX, 0)];
        let mut enc = Encoder::new();
        let Message::PullReq(m) = decoded(enc.pull_req(11, &modules)) else {
            panic!("wrong type")
        };
        let v = m.validate().unwrap();
        assert_eq!(v.seq, 11);
        assert_eq!(v.modules().collect::<Vec<_>>(), modules);
    }

    #[test]
    fn route_answer_and_push_round_trip() {
        let nodes = route();
        let mut enc = Encoder::new();
        let Message::RouteAnswer(m) = decoded(enc.route_answer(11, M, true, 99, &nodes)) else {
            panic!("wrong type")
        };
        assert_eq!((m.seq(), m.modid(), m.cmdid()), (11, M.modid, M.cmdid));
        assert_eq!(
            (m.exists(), m.version(), plain(m.nodes())),
            (true, 99, nodes.to_vec())
        );

        let Message::RouteAnswer(m) = decoded(enc.route_answer(12, M, false, 0, &[])) else {
            panic!("wrong type")
        };
        assert!(!m.exists() && plain(m.nodes()).is_empty());

        let Message::RoutePush(m) = decoded(enc.route_push(M, true, 100, &nodes)) else {
            panic!("wrong type")
        };
        assert_eq!((m.modid(), m.cmdid()), (M.modid, M.cmdid));
        assert_eq!(
            (m.exists(), m.version(), plain(m.nodes())),
            (true, 100, nodes.to_vec())
        );
    }

    #[test]
    fn keep_alive_and_ack_round_trip() {
        let mut enc = Encoder::new();
        let Message::KeepAlive(m) = decoded(enc.keep_alive(21)) else {
            panic!("wrong type")
        };
        assert_eq!(m.seq(), 21);
        let Message::KeepAliveAck(m) = decoded(enc.keep_alive_ack(21)) else {
            panic!("wrong type")
        };
        assert_eq!(m.seq(), 21);
    }

    #[test]
    fn stats_report_and_ack_round_trip() {
        let a = [
            NodeStats {
                addr: addr(1, 1),
                succ: 100,
                err: 3,
                overloaded: false,
            },
            NodeStats {
                addr: addr(2, 2),
                succ: 0,
                err: 50,
                overloaded: true,
            },
        ];
        let modules = [
            ModuleStats {
                module: M,
                nodes: &a,
                consumed: &[],
            },
            ModuleStats {
                module: ModuleId::new(1, 1),
                nodes: &[],
                consumed: &[],
            },
        ];
        let mut enc = Encoder::new();
        let buf = enc.stats_report(31, 0x7f00_0001, 1_700_000_000, &modules);
        let Message::StatsReport(m) = decoded(buf) else {
            panic!("wrong type")
        };
        assert_eq!(
            (m.seq(), m.caller(), m.time_s()),
            (31, 0x7f00_0001, 1_700_000_000)
        );
        let got: Vec<(ModuleId, Vec<NodeStats>)> = m
            .modules()
            .unwrap()
            .iter()
            .map(|ms| {
                let nodes = ms.nodes().unwrap_or_default().iter().map(NodeStats::from);
                (ModuleId::new(ms.modid(), ms.cmdid()), nodes.collect())
            })
            .collect();
        assert_eq!(got, vec![(M, a.to_vec()), (ModuleId::new(1, 1), vec![])]);
        assert_eq!(m.agent_start(), 0, "stats_report names no run");
        let Message::StatsReport(m) =
            decoded(enc.stats_report_of_run(32, 1, 2, 0xfeed_beef, &modules))
        else {
            panic!("wrong type")
        };
        assert_eq!((m.seq(), m.agent_start()), (32, 0xfeed_beef));

        let Message::StatsAck(m) = decoded(enc.stats_ack(31)) else {
            panic!("wrong type")
        };
        assert_eq!(m.seq(), 31);
    }

    #[test]
    fn the_buffer_is_reused_not_reallocated_after_warm_up() {
        let mut enc = Encoder::new();
        let report = Report {
            seq: 1,
            module: M,
            host: addr(1, 1),
            retcode: 0,
            tcost_ms: 1,
            downstream_level: None,
            consumed: 0,
        };
        let first = enc.report_req(&report).as_ptr_range().end;
        for seq in 0..1000 {
            enc.get_host_req(seq, M, 0, 0);
            let end = enc.report_req(&report).as_ptr_range().end;
            assert_eq!(end, first, "the builder's buffer moved");
        }
    }

    #[test]
    fn a_get_host_exchange_fits_well_within_a_datagram() {
        let mut enc = Encoder::new();
        assert!(enc.get_host_req(1, M, 1, 1).len() <= 64);
        assert!(
            enc.get_host_resp(1, M, RetCode::Ok, Some(addr(1, 1)), None)
                .len()
                <= 80
        );
    }
}
