//! The shard's own admission control (`admission.agent_shedding`): each
//! datagram's queuing time feeds a DAGOR window, and a getHost below the
//! shard's level is shed before any module lookup ([`super::gethost`]
//! reads the level). Also the kernel's drop count, which makes a window
//! overloaded.

use super::{Queued, ShardCore};
use lbagent_admission::{Admission, AdmissionLevel, AdmissionParams, Micros, OPEN};

impl ShardCore {
    /// Turns the shard's own admission control on (`Some`) or off. While
    /// on, [`ShardCore::handle_queued`] feeds it each datagram's queuing
    /// time and a getHost its level does not admit is answered `Rejected`
    /// with the shard's level attached. See [`agent_params`] for how the
    /// parameters are adapted to a shard.
    pub fn set_shedding(&mut self, params: Option<AdmissionParams>) {
        self.shedding = params.map(|p| Box::new(Admission::new(agent_params(p))));
        self.metrics.self_level = OPEN;
        self.drops_seen = 0;
    }

    /// The kernel's count of datagrams it dropped on this shard's socket
    /// for want of receive buffer (`SO_RXQ_OVFL`, as the latest datagram
    /// carried it: a running count that wraps). With shedding on, the
    /// drops since the last count make the current admission window
    /// overloaded ([`Admission::dropped`]): a receive buffer sized to the
    /// threshold overflows before its queue averages above the threshold.
    pub fn kernel_drops(&mut self, total: u32) {
        let new = total.wrapping_sub(self.drops_seen);
        self.drops_seen = total;
        if new > 0 {
            self.metrics.kernel_drops += u64::from(new);
            if let Some(a) = self.shedding.as_mut() {
                a.dropped(new);
            }
        }
    }

    /// The shard's own admission level (open when shedding is off).
    pub fn self_level(&self) -> AdmissionLevel {
        self.shedding.as_ref().map_or(OPEN, |a| a.level())
    }

    /// Ends the shard's admission window by time when it is due, so that
    /// the level moves even while no datagram arrives (the shell calls it
    /// every few milliseconds).
    pub fn tick_shedding(&mut self, now_us: Micros) {
        if let Some(a) = self.shedding.as_mut() {
            if let Some(o) = a.tick(now_us) {
                self.metrics.self_level = o.after;
            }
        }
    }

    /// When [`ShardCore::tick_shedding`] next has something to decide
    /// (realtime microseconds), None when shedding is off or its window
    /// needs no timer (see [`Admission::next_tick`]).
    pub fn shedding_due(&self) -> Option<Micros> {
        self.shedding.as_ref().and_then(|a| a.next_tick())
    }

    /// What every request does first: no kind yet; with `queued`, its
    /// queuing time counted and, with shedding on, fed to the shard's
    /// admission window. Returns whether the shard's level applies and the
    /// queuing-time bucket.
    #[inline]
    pub(super) fn queued_start(&mut self, queued: Option<Queued>) -> (bool, Option<(usize, u64)>) {
        self.last_kind = None;
        let mut shed = false;
        let mut bucket = None;
        if let Some(q) = queued {
            bucket = Some((self.metrics.record_queuing_us(q.waited_us), q.waited_us));
            if let Some(a) = self.shedding.as_mut() {
                if let Some(o) = a.started(q.now_us, q.waited_us) {
                    self.metrics.self_level = o.after;
                }
                shed = true;
            }
        }
        (shed, bucket)
    }
}

/// The admission parameters a shard's own shedding runs with: `p` with
/// `hold_while_draining` off (the kernel's receive queue holds every
/// datagram, admitted or not, so the counts do not measure its drain) and
/// `callers_hold_back` on (every answer carries the shard's level while it
/// sheds, and callers hold back below it: a calm window's rise is placed on
/// the demand's remembered mix, see [`Admission`]).
pub fn agent_params(p: AdmissionParams) -> AdmissionParams {
    AdmissionParams {
        hold_while_draining: false,
        callers_hold_back: true,
        ..p
    }
}
