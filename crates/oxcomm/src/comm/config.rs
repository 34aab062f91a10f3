//! The communicator's settings: [`CommConfig`] (per communicator, with its defaults read from
//! the environment) and [`OpOptions`] (per op). Every `OXCOMM_*` variable the communicator
//! itself reads is declared here with its default; the logger's are in [`crate::logging`].

use std::time::Duration;

use crate::algorithms::Algorithm;
use crate::logging::LoggerConfig;

/// Environment variable: default deadline of every blocking op, in seconds.
pub const ENV_TIMEOUT: &str = "OXCOMM_TIMEOUT";
/// Default of [`ENV_TIMEOUT`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Environment variable: the heartbeat lapse, in milliseconds: an op that has waited this long
/// gives up on a member that has shown no sign of life inside oxcomm for as long (it is
/// stopped, or stuck outside the library) instead of waiting for its deadline; `0` turns it
/// off. Default [`DEFAULT_SUSPECT_AFTER`].
pub const ENV_SUSPECT_AFTER: &str = "OXCOMM_SUSPECT_AFTER_MS";
/// Default of [`ENV_SUSPECT_AFTER`]: a tenth of [`DEFAULT_TIMEOUT`], longer than a rank
/// normally spends outside the library while others wait for it (a checkpoint save, say).
pub const DEFAULT_SUSPECT_AFTER: Duration = Duration::from_secs(30);
/// Default largest number of bytes one transfer call moves.
pub const DEFAULT_MAX_SEGMENT_BYTES: usize = 1 << 20;

/// Settings of a communicator. `Default` reads [`ENV_TIMEOUT`].
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Deadline of every blocking op unless [`OpOptions::timeout`] overrides it, counted
    /// from the first time the op has to wait for a peer.
    pub timeout: Duration,
    /// Largest number of bytes one transfer call moves; larger messages go in segments.
    pub max_segment_bytes: usize,
    /// Use this algorithm for every op it applies to (tests and benchmarks); `None` lets
    /// [`crate::algorithms::plan`] choose.
    pub algorithm: Option<Algorithm>,
    /// The comms logger's settings (default: from `OXCOMM_COMMS_LOGGER*`, off if unset).
    pub logger: LoggerConfig,
    /// The heartbeat lapse ([`ENV_SUSPECT_AFTER`]; zero: off): an op that has waited this long
    /// fails naming a member silent for as long, with the op that member was last seen in,
    /// and revokes the communicator, so the survivors can [`crate::Communicator::shrink`] it
    /// out. A lapse not shorter than an op's timeout never fires before the deadline.
    pub suspect_after: Duration,
}

impl Default for CommConfig {
    fn default() -> Self {
        let timeout = std::env::var(ENV_TIMEOUT)
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        let logger = LoggerConfig::from_env().unwrap_or_else(|e| {
            tracing::warn!(target: "oxcomm::comms", "ignoring the comms logger settings: {e}");
            LoggerConfig::default()
        });
        let suspect_after = std::env::var(ENV_SUSPECT_AFTER)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_SUSPECT_AFTER);
        CommConfig { timeout, max_segment_bytes: DEFAULT_MAX_SEGMENT_BYTES, algorithm: None, logger, suspect_after }
    }
}

/// Per-op knobs; `Default` means "use the communicator's settings".
#[derive(Debug, Clone, Default)]
pub struct OpOptions {
    /// Deadline of this op (counted from its first wait for a peer).
    pub timeout: Option<Duration>,
    /// Force an algorithm; an error if it does not apply to the op.
    pub algorithm: Option<Algorithm>,
    /// Segment size of this op.
    pub max_segment_bytes: Option<usize>,
}
