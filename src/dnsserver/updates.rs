//! The channel from the store thread to one serving executor: each new
//! table, and a doorbell that wakes the executor the moment one is sent,
//! so that a change is installed and pushed at once instead of at the
//! executor's next tick. A plain thread sends; a glommio task waits.

use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use super::reload::Update;
pub use lbagent_service::doorbell::Doorbell;

/// A new update channel: the store thread's end and the executor's.
pub fn channel() -> (UpdateSender, UpdateReceiver) {
    let (tx, rx) = mpsc::channel();
    let bell = Arc::new(Doorbell::default());
    (
        UpdateSender {
            tx: Some(tx),
            bell: bell.clone(),
        },
        UpdateReceiver { rx, bell },
    )
}

/// The store thread's end.
#[derive(Debug)]
pub struct UpdateSender {
    /// None only in `drop`, which closes the channel before it rings.
    tx: Option<mpsc::Sender<Arc<Update>>>,
    bell: Arc<Doorbell>,
}

impl UpdateSender {
    /// Sends `update` and wakes the executor. Err when the executor has
    /// stopped (its end is dropped).
    pub fn send(&self, update: Arc<Update>) -> Result<(), Arc<Update>> {
        let Some(tx) = &self.tx else {
            return Err(update);
        };
        tx.send(update).map_err(|e| e.0)?;
        self.bell.ring();
        Ok(())
    }
}

impl Drop for UpdateSender {
    /// The executor wakes to see the channel closed: closed first, then
    /// rung (rung first, it could look, find the channel empty but open,
    /// and wait for a ring that never comes).
    fn drop(&mut self) {
        drop(self.tx.take());
        self.bell.ring();
    }
}

/// The executor's end.
#[derive(Debug)]
pub struct UpdateReceiver {
    rx: mpsc::Receiver<Arc<Update>>,
    bell: Arc<Doorbell>,
}

impl UpdateReceiver {
    /// The next update waiting, if any; Err(Disconnected) once the store
    /// thread ended and everything it sent was taken.
    pub fn try_recv(&self) -> Result<Arc<Update>, TryRecvError> {
        self.rx.try_recv()
    }

    /// Waits up to `timeout` for the next update (threads and tests).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Arc<Update>, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    /// Waits until something was sent (or the sender dropped) since the
    /// last wait: then [`try_recv`](Self::try_recv) has it.
    pub async fn sent(&self) {
        self.bell.rung().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::task::{Context, Wake, Waker};

    fn update() -> Arc<Update> {
        Arc::new(Update {
            table: Arc::new(super::super::table::RouteTable::unloaded()),
            changes: Vec::new(),
            first_load: false,
        })
    }

    #[test]
    fn every_send_from_another_thread_is_seen_after_a_wake() {
        let (tx, rx) = channel();
        let sender = std::thread::spawn(move || {
            for _ in 0..1000 {
                tx.send(update()).unwrap();
            }
            // Dropping the sender rings too.
        });
        let mut got = 0;
        futures_lite::future::block_on(async {
            loop {
                rx.sent().await;
                loop {
                    match rx.try_recv() {
                        Ok(_) => got += 1,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => return,
                    }
                }
            }
        });
        sender.join().unwrap();
        assert_eq!(got, 1000);
    }

    /// Records what the receiver sees at the moment it is woken.
    struct SeesAtWake(Mutex<Option<UpdateReceiver>>, Mutex<Option<bool>>);

    impl Wake for SeesAtWake {
        fn wake(self: Arc<Self>) {
            let rx = self.0.lock().unwrap();
            let closed = matches!(
                rx.as_ref().map(|r| r.try_recv()),
                Some(Err(TryRecvError::Disconnected))
            );
            *self.1.lock().unwrap() = Some(closed);
        }
    }

    #[test]
    fn a_dropped_sender_is_already_closed_when_it_wakes_the_executor() {
        let (tx, rx) = channel();
        let bell = rx.bell.clone();
        let probe = Arc::new(SeesAtWake(Mutex::new(Some(rx)), Mutex::new(None)));
        let waker = Waker::from(probe.clone());
        assert!(bell
            .poll_rung(&mut Context::from_waker(&waker))
            .is_pending());
        drop(tx);
        assert_eq!(*probe.1.lock().unwrap(), Some(true), "woken, and closed");
    }

    #[test]
    fn sending_to_a_stopped_executor_fails() {
        let (tx, rx) = channel();
        drop(rx);
        assert!(tx.send(update()).is_err());
    }
}
