//! A coarse clock, for deadlines that are seconds long (leases, record
//! TTLs, idle upstream connections): it reads the time of the kernel's last
//! tick, a few milliseconds behind at most, for a few nanoseconds. A precise
//! reading costs about 20 ns in a virtual machine, and a request would take
//! a dozen of them; precise readings stay for latencies and client timeouts.

use tokio::time::Instant;

/// Now, give or take one clock tick (4 ms at `HZ=250`).
pub fn coarse_now() -> Instant {
    imp::coarse_now()
}

/// Milliseconds since the first call, on the coarse clock: a time to keep
/// in an atomic. Never 0, so 0 can stand for "none".
pub fn coarse_ms() -> u64 {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let now = coarse_now();
    let origin = *ORIGIN.get_or_init(|| now);
    let elapsed = now.saturating_duration_since(origin).as_millis();
    u64::try_from(elapsed).unwrap_or(u64::MAX).saturating_add(1)
}

/// The most [`coarse_now`] lags the precise clock by: one tick.
pub fn coarse_lag() -> std::time::Duration {
    imp::coarse_lag()
}

#[cfg(target_os = "linux")]
mod imp {
    use super::*;
    use rustix::time::{ClockId, clock_getres, clock_gettime};
    use std::sync::OnceLock;
    use std::time::Duration;

    fn coarse() -> Duration {
        let now = clock_gettime(ClockId::MonotonicCoarse);
        Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
    }

    /// An `Instant`, placed on the coarse clock's timeline by one pair of
    /// readings taken together: the two clocks run at one rate.
    pub fn coarse_now() -> Instant {
        static ORIGIN: OnceLock<(Instant, Duration)> = OnceLock::new();
        let (instant, coarse_then) = *ORIGIN.get_or_init(|| (Instant::now(), coarse()));
        instant + coarse().saturating_sub(coarse_then)
    }

    pub fn coarse_lag() -> Duration {
        static LAG: OnceLock<Duration> = OnceLock::new();
        *LAG.get_or_init(|| {
            let tick = clock_getres(ClockId::MonotonicCoarse);
            Duration::new(tick.tv_sec as u64, tick.tv_nsec as u32)
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::*;

    pub fn coarse_now() -> Instant {
        Instant::now()
    }

    pub fn coarse_lag() -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn coarse_time_keeps_within_a_few_ticks_of_the_precise_clock() {
        for _ in 0..50 {
            let before = Instant::now();
            let coarse = coarse_now();
            let after = Instant::now();
            // One tick behind, or ahead by the tick the origin was late.
            assert!(
                coarse + Duration::from_millis(25) >= before,
                "{coarse:?} far behind {before:?}"
            );
            assert!(
                coarse <= after + Duration::from_millis(25),
                "{coarse:?} far ahead of {after:?}"
            );
            std::thread::sleep(Duration::from_millis(3));
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn coarse_time_reaches_a_moment_about_one_lag_after_the_precise_clock() {
        let lag = coarse_lag();
        assert!(lag > Duration::ZERO && lag <= Duration::from_millis(10), "{lag:?}");
        let mut late = 0;
        for _ in 0..20 {
            let moment = coarse_now() + Duration::from_millis(3);
            let wake = (moment + lag).into_std();
            std::thread::sleep(wake.saturating_duration_since(std::time::Instant::now()));
            late += usize::from(coarse_now() < moment);
        }
        // A tick may come late (an idle machine's kernel skips ticks).
        assert!(late <= 2, "{late} of 20 readings had not reached the moment");
    }

    #[test]
    fn coarse_time_never_goes_back() {
        let mut last = coarse_now();
        for _ in 0..100_000 {
            let now = coarse_now();
            assert!(now >= last);
            last = now;
        }
    }
}
