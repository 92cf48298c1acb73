//! The patched glommio (src/vendor/glommio/LBAGENT-PATCH.md): an executor that
//! is preempted before it runs anything must not park with runnable tasks.
//! A 1 ns preemption timer makes every run preempted at once, as a loaded
//! machine does now and then with the default 100 ms; glommio 0.9.0 as
//! published hangs in both tests (caught here by the deadline), the
//! patched one finishes in milliseconds.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

/// Runs `work` on a fresh executor with a 1 ns preemption timer in its own
/// thread; panics if it has not finished within 30 s (a hung executor
/// thread is left behind: the test process ends anyway).
fn finishes_when_always_preempted(work: impl FnOnce(&glommio::LocalExecutor) + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let ex = glommio::LocalExecutorBuilder::default()
            .preempt_timer(Duration::from_nanos(1))
            .make()
            .unwrap();
        work(&ex);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the executor parked with runnable work and never woke");
}

#[test]
fn an_executor_preempted_before_it_runs_anything_does_not_park() {
    finishes_when_always_preempted(|ex| {
        for _ in 0..1000 {
            ex.run(async {});
        }
    });
}

#[test]
fn a_task_woken_by_its_timer_runs_even_when_the_executor_is_preempted() {
    // As the route server's tick: the only timer on the executor.
    finishes_when_always_preempted(|ex| {
        ex.run(async {
            for _ in 0..200 {
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
        })
    });
}
