//! Logs captured in memory: the tests of one binary share a global
//! subscriber, at debug level.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// Everything the tests of this binary log, at debug level.
pub fn captured() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        tracing_subscriber::fmt()
            .with_env_filter("debug")
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .init();
        logs
    })
    .clone()
}

/// What [`captured`] holds so far, as text.
pub fn text(logs: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&logs.lock().unwrap()).into_owned()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
