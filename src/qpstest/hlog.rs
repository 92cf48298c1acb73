//! `--hist-log FILE`: latency histograms as an HdrHistogram interval log
//! (`.hlog`), the format HdrHistogram's `HistogramLogProcessor`, its
//! plotters and the `hdrhistogram` crate's `IntervalLogIterator` read.
//!
//! The crate writes the lines (V2 compressed histograms, base64); this
//! file only holds the file open across a run. Values are in ns; each
//! interval's timestamp is seconds since the log's `BaseTime` (the run's
//! start), and its max column is in ns too.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use anyhow::Context;
use hdrhistogram::serialization::interval_log::{IntervalLogWriterBuilder, Tag};
use hdrhistogram::serialization::V2DeflateSerializer;
use hdrhistogram::Histogram;

/// An interval log being written.
pub struct HistLog {
    out: BufWriter<File>,
    serializer: V2DeflateSerializer,
    /// When the log started: its `BaseTime`.
    base: Instant,
    path: PathBuf,
}

impl HistLog {
    /// Creates the log at `path` with `comment` and its start and base
    /// times (now).
    ///
    /// # Errors
    /// The file cannot be created or written.
    pub fn create(path: &Path, comment: &str) -> anyhow::Result<HistLog> {
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut log = HistLog {
            out: BufWriter::new(file),
            serializer: V2DeflateSerializer::new(),
            base: Instant::now(),
            path: path.to_path_buf(),
        };
        let now = SystemTime::now();
        let headers = IntervalLogWriterBuilder::new()
            .add_comment(comment)
            .with_start_time(now)
            .with_base_time(now)
            .begin_log_with(&mut log.out, &mut log.serializer)
            .map(drop);
        headers
            .and_then(|()| {
                writeln!(
                    log.out,
                    "\"StartTimestamp\",\"Interval_Length\",\"Interval_Max\",\"Interval_Compressed_Histogram\""
                )
            })
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(log)
    }

    /// Appends `h` as the interval from `from` to `to`, tagged `tag` (a
    /// tag with a comma, a space or a line break is left out).
    ///
    /// # Errors
    /// The histogram cannot be serialized or the file written.
    pub fn write(
        &mut self,
        h: &Histogram<u64>,
        from: Instant,
        to: Instant,
        tag: Option<&str>,
    ) -> anyhow::Result<()> {
        // A builder with nothing set writes no header: one interval line.
        IntervalLogWriterBuilder::new()
            .begin_log_with(&mut self.out, &mut self.serializer)
            .map_err(anyhow::Error::from)
            .and_then(|mut w| {
                w.write_histogram(
                    h,
                    from.saturating_duration_since(self.base),
                    to.saturating_duration_since(from),
                    tag.and_then(Tag::new),
                )
                .map_err(|e| anyhow::anyhow!("{e}"))
            })
            .with_context(|| format!("cannot write the interval log {}", self.path.display()))
    }

    /// Flushes the log to its file.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn finish(mut self) -> anyhow::Result<()> {
        self.out
            .flush()
            .with_context(|| format!("cannot write {}", self.path.display()))
    }
}
