//! The output pump: copies each rank's stdout and stderr to the launcher's, one whole line at
//! a time with a `[RANK] ` prefix (unless `--no-prefix`), so lines of different ranks never
//! interleave. Each stream has its own thread, which says [`Event::OutputClosed`] when the
//! rank's end of the pipe closes.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::mpsc;

use super::supervise::Event;

/// Longest run of output without a newline kept before it is written out as one line.
const MAX_LINE: usize = 64 << 10;

/// Where a rank's stream is copied to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sink {
    Stdout,
    Stderr,
}

impl Sink {
    /// Writes `line` in one piece while holding the stream's lock, so lines of different ranks
    /// never interleave. Errors (a closed pipe) are ignored: the ranks' output is still drained.
    fn write_line(self, line: &[u8]) {
        let _ = match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(line).and_then(|()| out.flush())
            }
            Sink::Stderr => {
                let mut err = io::stderr().lock();
                err.write_all(line).and_then(|()| err.flush())
            }
        };
    }
}

/// Starts a thread copying `src` to `sink`; returns 1 if it started (0 if not, after which the
/// rank's output on that stream is lost but the rank can still write: the pipe is closed and
/// it gets `EPIPE`).
pub(super) fn start_pump(
    src: impl Read + Send + 'static,
    prefix: Option<String>,
    sink: Sink,
    tx: &mpsc::Sender<Event>,
    rank: usize,
) -> usize {
    let tx = tx.clone();
    let started = std::thread::Builder::new().name(format!("oxcomm-launch-out-{rank}")).spawn(move || {
        pump(src, prefix.as_deref().map(str::as_bytes), |line| sink.write_line(line));
        let _ = tx.send(Event::OutputClosed);
    });
    usize::from(started.is_ok())
}

/// Copies `src` to `write` one line at a time, each with `prefix` in front. With a prefix, a
/// last line without a newline gets one (so the next rank's line starts on its own). A run of
/// more than [`MAX_LINE`] bytes without a newline is written out in pieces of that size.
fn pump(src: impl Read, prefix: Option<&[u8]>, mut write: impl FnMut(&[u8])) {
    let prefix = prefix.unwrap_or_default();
    let mut reader = BufReader::with_capacity(MAX_LINE, src);
    let mut line = prefix.to_vec();
    let mut emit = |line: &mut Vec<u8>| {
        if !prefix.is_empty() && line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        write(line);
        line.truncate(prefix.len());
    };
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            break;
        }
        let (take, complete) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if complete || line.len() - prefix.len() >= MAX_LINE {
            emit(&mut line);
        }
    }
    if line.len() > prefix.len() {
        emit(&mut line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pumped(input: &[u8], prefix: Option<&str>) -> Vec<Vec<u8>> {
        let mut lines = Vec::new();
        pump(input, prefix.map(str::as_bytes), |line| lines.push(line.to_vec()));
        lines
    }

    #[test]
    fn pump_prefixes_each_line_and_ends_a_partial_one() {
        assert_eq!(pumped(b"a\nbc\npartial", Some("[3] ")), [&b"[3] a\n"[..], b"[3] bc\n", b"[3] partial\n"]);
        assert_eq!(pumped(b"a\npartial", None), [&b"a\n"[..], b"partial"]);
        assert_eq!(pumped(b"\n\n", Some("[0] ")), [&b"[0] \n"[..], b"[0] \n"]);
        assert!(pumped(b"", Some("[0] ")).is_empty());
    }

    #[test]
    fn pump_splits_overlong_lines() {
        let long = vec![b'x'; MAX_LINE * 2 + 10];
        let lines = pumped(&long, Some("[1] "));
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l.starts_with(b"[1] ") && l.ends_with(b"\n")));
        assert_eq!(lines.iter().map(|l| l.len() - 5).sum::<usize>(), long.len());
    }
}
