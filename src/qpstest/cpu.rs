//! CPU time of a server, read from `/proc`: the figure that makes a
//! throughput measurement honest on a machine where the load generator
//! competes with the server for the same cores.
//!
//! Owns the parsing of `/proc/PID/stat` and `/proc/PID/task/TID/{stat,comm}`
//! and nothing else.

use std::io;
use std::path::Path;

use nix::unistd::{gettid, sysconf, SysconfVar};

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of the times
/// in `/proc/*/stat`.
fn ticks_per_second() -> f64 {
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// The user + system CPU seconds in the text of a `/proc/.../stat` file.
///
/// # Errors
/// [`io::ErrorKind::InvalidData`] when the text is not a stat line (no
/// `)` closing the command name, or too few fields, or non-numeric times).
pub fn parse_stat_cpu_seconds(stat: &str) -> io::Result<f64> {
    let bad =
        |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad stat line: {what}"));
    // The command name may hold spaces and parentheses: the fields start
    // after the last `)`.
    let close = stat
        .rfind(')')
        .ok_or_else(|| bad("no `)` after the command name"))?;
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    // After the name: state(3) ppid pgrp session tty_nr tpgid flags minflt
    // cminflt majflt cmajflt utime(14) stime(15): indices 11 and 12 here.
    let (Some(utime), Some(stime)) = (fields.get(11), fields.get(12)) else {
        return Err(bad("fewer than 15 fields"));
    };
    let parse = |s: &str| {
        s.parse::<u64>()
            .map_err(|_| bad("utime/stime not a number"))
    };
    Ok((parse(utime)? + parse(stime)?) as f64 / ticks_per_second())
}

/// CPU seconds (user + system) used so far by thread `tid` of this process.
///
/// # Errors
/// The thread's stat file cannot be read (the thread is gone) or parsed.
pub fn thread_cpu_seconds(tid: u32) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))?;
    parse_stat_cpu_seconds(&stat)
}

/// CPU seconds (user + system) used so far by every thread of process `pid`.
///
/// # Errors
/// The process's stat file cannot be read (no such process, or another PID
/// namespace) or parsed.
pub fn process_cpu_seconds(pid: u32) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat_cpu_seconds(&stat)
}

/// CPU seconds (user + system) used so far by the threads of process `pid`
/// whose name (`comm`) satisfies `keep`, and how many threads matched.
///
/// # Errors
/// The process's task directory cannot be read. Threads that exit while
/// they are read are skipped.
pub fn named_threads_cpu_seconds(
    pid: u32,
    keep: impl Fn(&str) -> bool,
) -> io::Result<(f64, usize)> {
    let dir = format!("/proc/{pid}/task");
    let mut total = 0.0;
    let mut matched = 0;
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if !read_comm(&path).is_some_and(|c| keep(&c)) {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(path.join("stat")) {
            total += parse_stat_cpu_seconds(&stat)?;
            matched += 1;
        }
    }
    Ok((total, matched))
}

fn read_comm(task: &Path) -> Option<String> {
    std::fs::read_to_string(task.join("comm"))
        .ok()
        .map(|c| c.trim_end_matches('\n').to_string())
}

/// The calling thread's id (for [`thread_cpu_seconds`]).
pub fn current_tid() -> u32 {
    gettid().as_raw() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_stat_line_whose_name_has_spaces_and_parentheses() {
        let hz = ticks_per_second();
        let line = format!(
            "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 {} {} 0 0 20 0 1 0",
            (3.0 * hz) as u64,
            (hz / 2.0) as u64
        );
        let s = parse_stat_cpu_seconds(&line).unwrap();
        assert!((s - 3.5).abs() < 0.02, "{s}");
    }

    #[test]
    fn rejects_what_is_not_a_stat_line() {
        for bad in [
            "",
            "4242 no parenthesis",
            "1 (x) S 1 2",
            "1 (x) S 1 2 3 4 5 6 7 8 9 10 u s",
        ] {
            let e = parse_stat_cpu_seconds(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{bad:?}");
        }
    }

    #[test]
    fn a_busy_thread_shows_its_cpu_time_by_id_and_by_name() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("cpu-test-busy".into())
            .spawn(move || {
                let tid = current_tid();
                // Spin until this thread has used 50 ms of CPU (bounded: the
                // machine may be busy), then wait to be read.
                let t0 = std::time::Instant::now();
                while thread_cpu_seconds(tid).unwrap() < 0.05
                    && t0.elapsed() < std::time::Duration::from_secs(20)
                {
                    std::hint::black_box((0..10_000u64).sum::<u64>());
                }
                tx.send(tid).unwrap();
                let _ = done_rx.recv();
            })
            .unwrap();
        let tid = rx.recv().unwrap();
        let own = thread_cpu_seconds(tid).unwrap();
        let (named, n) =
            named_threads_cpu_seconds(std::process::id(), |c| c == "cpu-test-busy").unwrap();
        done_tx.send(()).unwrap();
        h.join().unwrap();
        assert!(own >= 0.05, "{own}");
        assert_eq!(n, 1);
        assert!((named - own).abs() < 0.05, "{named} vs {own}");
        assert!(process_cpu_seconds(std::process::id()).unwrap() >= own);
        assert!(thread_cpu_seconds(u32::MAX).is_err());
    }
}
