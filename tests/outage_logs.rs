//! The log while a store is down: the warnings it would repeat for every
//! request go out once a second. In a binary of its own, as the throttles
//! and the captured log are the process's.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::logs::captured;
use support::redis::redis_store;
use support::{Reply, TestClient, Upstream};

/// A store that is down fails every request: the log gets one line a second
/// about it, naming the cause and how many more it held back, and none
/// about releasing claims the store never received.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_logs_a_line_a_second_not_one_a_request() {
    let logs = captured();
    let upstream = Upstream::created().await;
    // Nothing listens there: every connection is refused.
    let down = support::unreachable_url().replace("http://", "redis://");
    let store = redis_store(&down);
    let route = "[[route]]\nname = \"outage\"\npath = \"/v1/outage\"\n";
    let proxy = support::Proxy::start_with_store(&upstream.url(), route, store).await;
    let client = TestClient::default();
    let lines = |what: &str| {
        let text = support::logs::text(&logs);
        text.lines()
            .filter(|line| line.contains(what) && line.contains("outage"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let started = tokio::time::Instant::now();
    for n in 0..20 {
        let refused = client.post(&proxy.url("/v1/outage"), &format!("k{n}"), "{}").await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{}", refused.text());
    }
    let first = lines("store claim failed");
    assert!(
        first
            .first()
            .is_some_and(|line| line.contains("Connection refused") && line.contains("suppressed=0")),
        "{first:?}"
    );

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let refused = client.post(&proxy.url("/v1/outage"), "later", "{}").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    // A line a second at most (two here, unless a loaded host made the
    // twenty take over a second), each counting those held back since the
    // one before: all 21 failures told, none twice.
    let all = lines("store claim failed");
    let seconds = started.elapsed().as_secs() as usize;
    assert!((2..=seconds + 1).contains(&all.len()), "{seconds} s: {all:?}");
    let told: usize = all
        .iter()
        .map(|line| {
            let count = line.split("suppressed=").nth(1).expect("a count of those held back");
            1 + count
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse::<usize>().ok())
                .expect("a number")
        })
        .sum();
    assert_eq!(told, 21, "{all:?}");
    let text = support::logs::text(&logs);
    assert!(!text.contains("releasing a claim failed"), "{text}");
    assert_eq!(upstream.hits(), 0);
    // Redis is down, not refusing the channel: no ACL is blamed. (Refused,
    // or reset where another test's listener took the closed port a
    // moment: the lines of this binary's other tests, one of which is
    // refused the channel, share the log.)
    let down = |l: &str| l.contains("Connection refused") || l.contains("Connection reset");
    let subscribe: Vec<_> = text
        .lines()
        .filter(|l| l.contains("cannot subscribe") && down(l))
        .collect();
    assert!(!subscribe.is_empty(), "{text}");
    assert!(
        subscribe.iter().all(|l| !l.contains("needs the channel")),
        "{subscribe:?}"
    );
}

/// Redis going away under requests that last renews none of their leases:
/// each would warn at every renewal (a third of `lock_timeout`); the log
/// gets at most one such line a second, counting the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_lease_renewals_log_a_line_a_second() {
    let logs = captured();
    let mut redis = support::redis::RedisServer::start();
    let upstream = Upstream::start(|hit, _| Reply::created(hit).delayed(Duration::from_millis(2500))).await;
    let store = redis_store(&redis.url());
    let route = "[[route]]\nname = \"renewals\"\npath = \"/v1/slow\"\nlock_timeout = \"1s\"\n";
    let proxy = support::Proxy::start_with_store(&upstream.url(), route, store).await;
    let url = proxy.url("/v1/slow");
    let slow: Vec<_> = (0..5)
        .map(|n| {
            let url = url.clone();
            tokio::spawn(async move { TestClient::default().post(&url, &format!("slow{n}"), "{}").await })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while upstream.hits() < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of 5 forwarded",
            upstream.hits()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    redis.kill();
    for request in slow {
        request.await.unwrap();
    }
    let text = support::logs::text(&logs);
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("lease renewal failed"))
        .collect();
    // Five requests renewing every 333 ms for about two seconds: some 30
    // failures, at most three seconds' lines.
    assert!((1..=3).contains(&lines.len()), "{lines:#?}");
    let counted: u64 = lines
        .iter()
        .filter_map(|line| line.split("suppressed=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    assert!(counted >= 5, "{lines:#?}");
}

/// A Redis user the ACL denies the completion channel (Redis 7's default
/// for new users): the log says so once, naming the channel to grant, not
/// at every try to subscribe again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_completion_subscription_is_logged_once_naming_the_channel() {
    let logs = captured();
    let redis = support::redis::RedisServer::start_with_args(&["--acl-pubsub-default", "resetchannels"]);
    redis
        .cli(&["acl", "setuser", "gate", "on", ">s3cret-pw", "~*", "+@all"])
        .expect("the user is made");
    let _store = redis_store(&redis.url().replace("redis://", "redis://gate:s3cret-pw@"));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let text = support::logs::text(&logs);
    let refused: Vec<_> = text
        .lines()
        .filter(|line| line.contains("cannot subscribe to Redis completions") && line.contains("NoPerm"))
        .collect();
    assert_eq!(refused.len(), 1, "{refused:?} {text}");
    assert!(refused[0].contains("`&idemgate:done`"), "{refused:?}");
    assert!(!text.contains("s3cret-pw"), "{text}");
    // It was tried again meanwhile, without another line.
    let stats = redis.cli(&["info", "errorstats"]).unwrap();
    let tries: u32 = stats
        .lines()
        .find_map(|l| l.strip_prefix("errorstat_NOPERM:count="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(tries >= 2, "{stats}");
}
