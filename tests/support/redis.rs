//! Real `redis-server` processes on loopback ports of their own: a
//! standalone server and a three-master cluster. Killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A store on the Redis at `url`, its calls and the handle's deadline 1 s
/// each.
pub fn redis_store(url: &str) -> idemgate::store::StoreHandle {
    redis_store_within(url, Duration::from_secs(1))
}

/// [`redis_store`] with calls and deadline of `timeout`.
pub fn redis_store_within(url: &str, timeout: Duration) -> idemgate::store::StoreHandle {
    copied_store_within(url, 0, timeout)
}

/// [`redis_store_within`], whose writes count once `replicas` replicas
/// hold them (`store.wait_for_replicas`).
pub fn copied_store_within(url: &str, replicas: u32, timeout: Duration) -> idemgate::store::StoreHandle {
    idemgate::store::StoreHandle::new(
        std::sync::Arc::new(idemgate::store::RedisStore::single_copied(url, "idemgate", timeout, replicas).unwrap()),
        timeout,
    )
}

/// A store on the Redis Cluster found through `urls`, with calls and
/// deadline of `timeout`, as the proxy opens it.
pub fn cluster_store_within(urls: &[String], timeout: Duration) -> idemgate::store::StoreHandle {
    idemgate::store::StoreHandle::new(
        std::sync::Arc::new(idemgate::store::RedisStore::cluster(urls, "idemgate", timeout).unwrap()),
        timeout,
    )
}

/// A free loopback port (and, for a cluster node, its bus port + 10000).
fn free_port(with_bus: bool) -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !with_bus {
            return port;
        }
        if port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

fn cli(port: u16, args: &[&str]) -> Option<String> {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Whether a write to `primary` (under a key of its own slots, in a
/// cluster) is held by a replica within 100 ms, as `WAIT` counts: a
/// replica in sync is counted only once the primary has its first
/// acknowledgement (it sends one each second).
fn copied(primary: &RedisServer) -> bool {
    for i in 0..256 {
        let mut session = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut input = session.stdin.take().unwrap();
        let commands = format!("SET replica-acknowledged-{i} 1\nWAIT 1 100\n");
        std::io::Write::write_all(&mut input, commands.as_bytes()).unwrap();
        drop(input);
        let output = session.wait_with_output().unwrap();
        let output = String::from_utf8_lossy(&output.stdout);
        // Else the key is another node's (MOVED): the next one.
        if output.lines().next() == Some("OK") {
            return output.lines().last() == Some("1");
        }
    }
    false
}

fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(free_port(false), &[])
    }

    /// A server started with these extra `redis-server` arguments.
    pub fn start_with_args(extra: &[&str]) -> RedisServer {
        RedisServer::start_with(free_port(false), extra)
    }

    fn start_with(port: u16, extra: &[&str]) -> RedisServer {
        let dir = std::env::temp_dir().join(format!("idemgate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = RedisServer {
            port,
            child: None,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.restart();
        server
    }

    /// A replica of `primary`, in sync with it.
    pub fn start_replica_of(primary: &RedisServer) -> RedisServer {
        // Else the primary waits 5 s for more replicas before it sends the first copy.
        primary
            .cli(&["config", "set", "repl-diskless-sync-delay", "0"])
            .unwrap();
        let replica = RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        wait_until("the replica to acknowledge a write", || copied(primary));
        replica
    }

    /// A server in cluster mode that alone holds every hash slot: a
    /// one-shard cluster, as managed services offer.
    pub fn start_one_shard_cluster() -> RedisServer {
        let port = free_port(true);
        let config_file = format!("nodes-{port}.conf");
        let server = RedisServer::start_with(
            port,
            &["--cluster-enabled", "yes", "--cluster-config-file", &config_file],
        );
        assert!(server.cli(&["cluster", "addslotsrange", "0", "16383"]).is_some());
        wait_until("the cluster to be ok", || {
            server
                .cli(&["cluster", "info"])
                .is_some_and(|i| i.contains("cluster_state:ok"))
        });
        server
    }

    /// A node in cluster mode that holds no slots, to be met by a cluster.
    pub fn start_cluster_node() -> RedisServer {
        let port = free_port(true);
        let config_file = format!("nodes-{port}.conf");
        RedisServer::start_with(
            port,
            &["--cluster-enabled", "yes", "--cluster-config-file", &config_file],
        )
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Starts the process again (after [`RedisServer::kill`]) on the same port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none());
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        self.child = Some(child);
        let port = self.port;
        wait_until("redis-server to answer", || {
            cli(port, &["ping"]).is_some_and(|o| o.contains("PONG"))
        });
    }

    /// Stops the process (SIGSTOP), as a hung one or a paused machine:
    /// its port still takes connections, and nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, name: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        assert!(Command::new("kill").args([name, &pid]).status().unwrap().success());
    }

    /// SIGKILLs the process.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn cli(&self, args: &[&str]) -> Option<String> {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A node in cluster mode that fails a peer over after 2 s of silence,
/// with these extra `redis-server` arguments.
fn cluster_node(extra: &[&str]) -> RedisServer {
    let port = free_port(true);
    let config_file = format!("nodes-{port}.conf");
    let mut args = vec![
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        &config_file,
        "--cluster-node-timeout",
        "2000",
    ];
    args.extend_from_slice(extra);
    RedisServer::start_with(port, &args)
}

/// Three masters, no replicas, all slots covered.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        RedisCluster::start_with_args(&[])
    }

    /// A cluster whose nodes get these extra `redis-server` arguments.
    pub fn start_with_args(extra: &[&str]) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3).map(|_| cluster_node(extra)).collect();
        let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        for node in &nodes {
            wait_until("the cluster to be ok", || {
                node.cli(&["cluster", "info"])
                    .is_some_and(|i| i.contains("cluster_state:ok"))
            });
        }
        RedisCluster { nodes }
    }

    /// A replica of `nodes[index]`, joined to the cluster and in sync.
    pub fn add_replica_of(&self, index: usize) -> RedisServer {
        let primary = &self.nodes[index];
        let replica = cluster_node(&[]);
        let id = primary.cli(&["cluster", "myid"]).unwrap().trim().to_owned();
        replica
            .cli(&["cluster", "meet", "127.0.0.1", &primary.port.to_string()])
            .unwrap();
        wait_until("the replica to meet the cluster", || {
            replica
                .cli(&["cluster", "nodes"])
                .is_some_and(|nodes| nodes.contains(&id))
        });
        wait_until("the replica to replicate", || {
            replica
                .cli(&["cluster", "replicate", &id])
                .is_some_and(|o| o.contains("OK"))
        });
        wait_until("the replica to be in sync", || {
            replica
                .cli(&["info", "replication"])
                .is_some_and(|i| i.contains("master_link_status:up"))
        });
        wait_until("the replica to acknowledge a write", || copied(primary));
        replica
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }
}
