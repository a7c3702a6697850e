//! The store contract: one suite, written once, run against every backend.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idemgate::store::{
    Claim, EmbeddedStore, Fingerprint, MemoryStore, Outcome, Owner, Record, RecordKey, RedisStore, Store, StoreError,
    StoreHandle, StoredResponse,
};
use tokio::time::Instant;

const LONG: Duration = Duration::from_secs(30);
const A: Fingerprint = Fingerprint([0xaa; 32]);
const B: Fingerprint = Fingerprint([0xbb; 32]);
/// More than the stores' clocks may differ from the test's: the coarse
/// clock's tick, a Redis server's reading.
const CLOCK_SLACK: Duration = Duration::from_millis(50);

/// A fresh key per call, so tests sharing a backend never collide.
fn key() -> RecordKey {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&n.to_be_bytes());
    k[8..16].copy_from_slice(&(std::process::id() as u64).to_be_bytes());
    k[16..24].copy_from_slice(&Instant::now().elapsed().as_nanos().to_be_bytes()[8..]);
    RecordKey(k)
}

fn response(body: &'static str) -> Outcome {
    let multi = HeaderName::from_static("x-multi");
    Outcome::Response(Arc::new(StoredResponse::new(
        StatusCode::CREATED,
        &[
            (
                &HeaderName::from_static("content-type"),
                &HeaderValue::from_static("application/json"),
            ),
            (&multi, &HeaderValue::from_static("1")),
            (&multi, &HeaderValue::from_static("2")),
        ],
        &[Bytes::from_static(body.as_bytes())],
    )))
}

pub async fn claim_race_has_one_winner(store: Arc<dyn Store>) {
    let k = key();
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap() })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.unwrap() {
            Claim::Claimed => winners += 1,
            Claim::InFlight { fingerprint } => assert_eq!(fingerprint, A),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(winners, 1);
}

pub async fn completion_is_replayed_with_its_fingerprint(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    assert_eq!(store.claim(&k, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
    assert!(
        store
            .complete(&k, &A, owner, response("{\"id\":1}"), LONG)
            .await
            .unwrap()
    );
    for fingerprint in [A, B] {
        let claim = store.claim(&k, &fingerprint, Owner::new(), LONG, None).await.unwrap();
        assert_eq!(
            claim,
            Claim::Completed {
                fingerprint: A,
                outcome: response("{\"id\":1}")
            }
        );
    }
}

pub async fn outcomes_without_a_body_round_trip(store: Arc<dyn Store>) {
    for outcome in [Outcome::NotReplayable, Outcome::Unknown] {
        let k = key();
        let owner = Owner::new();
        store.claim(&k, &A, owner, LONG, None).await.unwrap();
        assert!(store.complete(&k, &A, owner, outcome.clone(), LONG).await.unwrap());
        assert_eq!(
            store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
            Claim::Completed {
                fingerprint: A,
                outcome
            }
        );
    }
}

pub async fn a_mismatch_is_reported_with_the_first_fingerprint(store: Arc<dyn Store>) {
    let k = key();
    store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap();
    match store.claim(&k, &B, Owner::new(), LONG, None).await.unwrap() {
        Claim::InFlight { fingerprint, .. } => assert_eq!(fingerprint, A),
        other => panic!("{other:?}"),
    }
}

pub async fn records_expire_after_their_ttl(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    store
        .complete(&k, &A, owner, response("x"), Duration::from_millis(1000))
        .await
        .unwrap();
    assert!(matches!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed { .. }
    ));
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Claimed
    );
}

pub async fn refresh_on_replay_restarts_the_ttl(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    // Margins of a second: a loaded CI machine may stall a step that long.
    let ttl = Duration::from_millis(1500);
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    store.complete(&k, &A, owner, response("x"), ttl).await.unwrap();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let claim = store.claim(&k, &A, Owner::new(), LONG, Some(ttl)).await.unwrap();
        assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
    }
    // A different fingerprint does not refresh.
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.claim(&k, &B, Owner::new(), LONG, Some(ttl)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Claimed
    );
}

/// Only a replay restarts the TTL: a record that answers retries with a
/// refusal (`outcome-unknown`, `response-not-replayable`) expires when its
/// TTL passes however often it is retried.
pub async fn refresh_on_replay_leaves_other_outcomes_to_expire(store: Arc<dyn Store>) {
    let ttl = Duration::from_millis(1500);
    // A call is judged only when its answer tells: a retry must find the
    // record when it was answered within a TTL of the completion's
    // sending, and the last claim must find it gone when it came a TTL
    // after the completion's answer yet within a TTL of the last retry's
    // sending (a refreshed record would still be there). A host so loaded
    // that a step overran says nothing, and the test starts again on new
    // keys, a few times at most.
    'attempt: for _ in 0..5 {
        let mut keys = Vec::new();
        for outcome in [Outcome::Unknown, Outcome::NotReplayable] {
            let (k, owner) = (key(), Owner::new());
            store.claim(&k, &A, owner, LONG, None).await.unwrap();
            let sent = Instant::now();
            assert!(store.complete(&k, &A, owner, outcome.clone(), ttl).await.unwrap());
            keys.push((k, outcome, sent, Instant::now()));
        }
        // Retries at 0.5 s and 1 s would keep them until 2.5 s if refreshed.
        let mut retried = None;
        for _ in 0..2 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            retried = Some(Instant::now());
            for (k, _, sent, _) in &keys {
                let claim = store.claim(k, &A, Owner::new(), LONG, Some(ttl)).await.unwrap();
                if sent.elapsed() >= ttl - CLOCK_SLACK {
                    continue 'attempt;
                }
                assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
            }
        }
        let answered = keys.iter().map(|(.., answered)| *answered).max().expect("two keys");
        tokio::time::sleep_until(answered + ttl + CLOCK_SLACK).await;
        for (k, outcome, ..) in &keys {
            let claim = store.claim(k, &A, Owner::new(), LONG, None).await.unwrap();
            if retried.expect("two rounds of retries").elapsed() >= ttl - CLOCK_SLACK {
                continue 'attempt;
            }
            assert_eq!(claim, Claim::Claimed, "{outcome:?} was refreshed");
        }
        return;
    }
    panic!("no attempt ran within its TTLs: the host is too loaded to tell");
}

/// A claim is idempotent for its owner: the Redis Cluster client resends a
/// command after a dropped connection, and the resent claim must not take
/// the first one's work for someone else's (a 409 until the lease ran out).
pub async fn a_claim_that_finds_its_own_claim_is_claimed(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    assert_eq!(store.claim(&k, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
    assert_eq!(store.claim(&k, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
    assert!(matches!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(store.complete(&k, &A, owner, response("x"), LONG).await.unwrap());
    assert!(matches!(
        store.claim(&k, &A, owner, LONG, None).await.unwrap(),
        Claim::Completed { .. }
    ));
}

pub async fn release_frees_the_key_for_its_owner_only(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    assert!(
        !store.release(&k, Owner::new()).await.unwrap(),
        "a stranger cannot release"
    );
    assert!(matches!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(store.release(&k, owner).await.unwrap());
    assert_eq!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Claimed
    );
}

pub async fn an_owner_whose_lease_ran_out_cannot_touch_its_successor(store: Arc<dyn Store>) {
    let k = key();
    let (old, new) = (Owner::new(), Owner::new());
    store
        .claim(&k, &A, old, Duration::from_millis(200), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(store.claim(&k, &B, new, LONG, None).await.unwrap(), Claim::Claimed);
    assert!(!store.renew(&k, old, LONG).await.unwrap());
    assert!(!store.complete(&k, &B, old, response("stale"), LONG).await.unwrap());
    assert!(!store.release(&k, old).await.unwrap());
    assert!(store.complete(&k, &B, new, response("fresh"), LONG).await.unwrap());
    assert_eq!(
        store.claim(&k, &B, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed {
            fingerprint: B,
            outcome: response("fresh")
        }
    );
}

/// A lease that ran out (a store that stalled past it) with nobody
/// claiming the key since: the completion still lands, so the answer the
/// client got is kept and its retry replays it rather than run again.
pub async fn a_completion_after_its_lease_ran_out_keeps_the_answer(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    store
        .claim(&k, &A, owner, Duration::from_millis(200), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(store.complete(&k, &A, owner, response("kept"), LONG).await.unwrap());
    assert_eq!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed {
            fingerprint: A,
            outcome: response("kept")
        }
    );
}

pub async fn renewal_keeps_a_claim_past_its_first_lease(store: Arc<dyn Store>) {
    let lease = Duration::from_millis(1000);
    // Each call is checked only when it answered within a lease of the
    // sending of the call that set the lease before it: only then must
    // that lease still have held. A host so loaded that one did not (a
    // 250 ms sleep overrunning by most of a second) says nothing of the
    // store, and the test starts again on a new key, a few times at most.
    'attempt: for _ in 0..5 {
        let k = key();
        let owner = Owner::new();
        let mut leased = Instant::now();
        store.claim(&k, &A, owner, lease, None).await.unwrap();
        let in_time = |since: Instant| since.elapsed() < lease - CLOCK_SLACK;
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let sent = Instant::now();
            let renewed = store.renew(&k, owner, lease).await.unwrap();
            if !in_time(leased) {
                continue 'attempt;
            }
            assert!(renewed, "renewed within its lease");
            leased = sent;
        }
        let other = store.claim(&k, &A, Owner::new(), lease, None).await.unwrap();
        let completed = store.complete(&k, &A, owner, response("x"), LONG).await.unwrap();
        if !in_time(leased) {
            continue;
        }
        assert!(matches!(other, Claim::InFlight { .. }), "{other:?}");
        assert!(completed);
        assert!(
            !store.renew(&k, owner, lease).await.unwrap(),
            "a completed record has no lease"
        );
        return;
    }
    panic!("no attempt ran within its leases: the host is too loaded to tell");
}

pub async fn waiters_wake_on_completion_and_release(store: Arc<dyn Store>) {
    // Let a store that subscribes to notifications finish subscribing (one
    // that is later wakes every waiter when it has, and they look again).
    tokio::time::sleep(Duration::from_millis(200)).await;
    for complete in [true, false] {
        let mut tries = 0;
        loop {
            tries += 1;
            let k = key();
            let owner = Owner::new();
            store.claim(&k, &A, owner, LONG, None).await.unwrap();
            let started = Instant::now();
            // As the gateway waits: wait, then look again while in flight.
            let waiter = tokio::spawn({
                let store = store.clone();
                async move {
                    let mut wakes = Vec::new();
                    loop {
                        store.wait(&k, Duration::from_secs(10)).await.unwrap();
                        wakes.push(Instant::now());
                        match store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap() {
                            Claim::InFlight { .. } => {}
                            _ => return wakes,
                        }
                    }
                }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            let sent = Instant::now();
            if complete {
                store.complete(&k, &A, owner, response("x"), LONG).await.unwrap();
            } else {
                store.release(&k, owner).await.unwrap();
            }
            let wakes = waiter.await.unwrap();
            // A host so loaded that the 200 ms sleep overran by half a
            // second leaves too little room to tell a notification from a
            // re-check (a second after the wait began): tried again.
            if sent - started > Duration::from_millis(500) && tries < 5 {
                continue;
            }
            let waited = *wakes.last().expect("woken at least once") - started;
            // Woken by the notification, not by a re-check or the timeout,
            // nor by polling before it: at most one wake-up before the
            // completion was sent (a subscription made late wakes all).
            assert!(waited < Duration::from_millis(900), "woken late: {waited:?}");
            let early = wakes.iter().filter(|&&wake| wake < sent).count();
            assert!(early <= 1 && wakes.len() <= 3, "{wakes:?}, completed at {sent:?}");
            break;
        }
    }
}

pub async fn waiting_is_bounded_and_immediate_when_nothing_is_in_flight(store: Arc<dyn Store>) {
    let started = Instant::now();
    store.wait(&key(), Duration::from_secs(10)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(1));
    let k = key();
    store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap();
    // A wait may end early (Redis wakes every waiter when its subscription
    // is made or lost, and the gateway then looks again), as the gateway
    // waits, again until its deadline: a few wake-ups, never a spin.
    let started = Instant::now();
    let deadline = started + Duration::from_millis(300);
    let mut wakes = 0;
    while Instant::now() < deadline {
        store.wait(&k, deadline - Instant::now()).await.unwrap();
        wakes += 1;
    }
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    assert!(wakes <= 3, "{wakes} wake-ups in {waited:?}");
}

pub async fn operators_inspect_and_purge_any_record(store: Arc<dyn Store>) {
    let k = key();
    let owner = Owner::new();
    assert_eq!(store.inspect(&k).await.unwrap(), None);
    assert!(!store.purge(&k).await.unwrap());
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    let (record, left) = store.inspect(&k).await.unwrap().unwrap();
    assert_eq!(record, Record::InFlight { fingerprint: A, owner });
    assert!(left <= LONG && left > LONG / 2, "{left:?}");
    assert!(
        store.purge(&k).await.unwrap(),
        "a stuck claim is purged whoever holds it"
    );
    let successor = Owner::new();
    assert_eq!(
        store.claim(&k, &A, successor, LONG, None).await.unwrap(),
        Claim::Claimed
    );
    store.complete(&k, &A, successor, response("done"), LONG).await.unwrap();
    let (record, _) = store.inspect(&k).await.unwrap().unwrap();
    assert_eq!(
        record,
        Record::Completed {
            fingerprint: A,
            outcome: response("done")
        }
    );
    assert!(store.purge(&k).await.unwrap());
    assert_eq!(store.inspect(&k).await.unwrap(), None);

    // A record past its TTL, not yet swept, is gone for a purge too.
    let expired = key();
    let owner = Owner::new();
    store.claim(&expired, &A, owner, LONG, None).await.unwrap();
    let ttl = Duration::from_millis(100);
    store.complete(&expired, &A, owner, response("old"), ttl).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!store.purge(&expired).await.unwrap(), "an expired record is purged");
    assert_eq!(store.inspect(&expired).await.unwrap(), None);
}

pub async fn a_lease_that_runs_out_ends_a_wait_without_a_spin(store: Arc<dyn Store>) {
    let k = key();
    // Before the claim: its lease runs from when the store takes it.
    let started = Instant::now();
    store
        .claim(&k, &A, Owner::new(), Duration::from_millis(300), None)
        .await
        .unwrap();
    // As the gateway waits: claim, and wait while the key is in flight.
    let mut wakes = 0;
    loop {
        match store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap() {
            Claim::Claimed => break,
            Claim::InFlight { .. } => {}
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5), "the lease never ran out");
        store.wait(&k, Duration::from_secs(10)).await.unwrap();
        wakes += 1;
    }
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250), "claimed after {waited:?}");
    assert!(wakes <= 3, "{wakes} wake-ups in {waited:?}");
}

/// Random operations on a few keys by a few owners, each answer checked
/// against a model of the contract (no record expires: leases and TTLs are
/// long). Every backend keeps the same books.
pub async fn random_operations_agree_with_a_model(store: Arc<dyn Store>) {
    operations_agree_with_a_model(store, |_, store| store).await;
}

/// [`random_operations_agree_with_a_model`], the store passed through
/// `between` before each step (which may put another in its place).
async fn operations_agree_with_a_model(
    mut store: Arc<dyn Store>,
    mut between: impl FnMut(usize, Arc<dyn Store>) -> Arc<dyn Store>,
) {
    #[derive(Clone, Debug, PartialEq)]
    enum Model {
        InFlight(usize),
        Completed(usize, Outcome),
    }
    let keys: Vec<RecordKey> = (0..5).map(|_| key()).collect();
    let owners: Vec<Owner> = (0..3).map(|_| Owner::new()).collect();
    // Each owner sends its own request: owners 0 and 1 the same one.
    let print = |owner: usize| if owner < 2 { A } else { B };
    let outcomes = [response("x"), response("yy"), Outcome::Unknown, Outcome::NotReplayable];
    let mut model: Vec<Option<Model>> = vec![None; keys.len()];
    let mut seed = 0x2545_F491_4F6C_DD1D_u64;
    let mut next = move |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    for step in 0..400 {
        store = between(step, store);
        let (at, who) = (next(keys.len()), next(owners.len()));
        let (k, owner, fp) = (&keys[at], owners[who], print(who));
        let held = model[at].clone();
        let mine = held == Some(Model::InFlight(who));
        match next(6) {
            0 | 1 => {
                let got = store.claim(k, &fp, owner, LONG, None).await.unwrap();
                let want = match &held {
                    None => {
                        model[at] = Some(Model::InFlight(who));
                        Claim::Claimed
                    }
                    Some(Model::InFlight(_)) if mine => Claim::Claimed,
                    Some(Model::InFlight(other)) => Claim::InFlight {
                        fingerprint: print(*other),
                    },
                    Some(Model::Completed(first, outcome)) => Claim::Completed {
                        fingerprint: print(*first),
                        outcome: outcome.clone(),
                    },
                };
                assert_eq!(got, want, "step {step}: claim of {at} by {who}, held {held:?}");
            }
            2 => {
                let outcome = outcomes[next(outcomes.len())].clone();
                let got = store.complete(k, &fp, owner, outcome.clone(), LONG).await.unwrap();
                // Where no record is left (a lease that ran out, a purged
                // claim), the answer is kept too.
                let writes = mine || held.is_none();
                if writes {
                    model[at] = Some(Model::Completed(who, outcome));
                }
                assert_eq!(got, writes, "step {step}: completion of {at} by {who}, held {held:?}");
            }
            3 => {
                let got = store.release(k, owner).await.unwrap();
                if mine {
                    model[at] = None;
                }
                assert_eq!(got, mine, "step {step}: release of {at} by {who}, held {held:?}");
            }
            4 => {
                let got = store.renew(k, owner, LONG).await.unwrap();
                assert_eq!(got, mine, "step {step}: renewal of {at} by {who}, held {held:?}");
            }
            _ if next(4) == 0 => {
                let got = store.purge(k).await.unwrap();
                model[at] = None;
                assert_eq!(got, held.is_some(), "step {step}: purge of {at}, held {held:?}");
            }
            _ => {
                let got = store.inspect(k).await.unwrap().map(|(record, _)| record);
                let want = held.map(|held| match held {
                    Model::InFlight(o) => Record::InFlight {
                        fingerprint: print(o),
                        owner: owners[o],
                    },
                    Model::Completed(o, outcome) => Record::Completed {
                        fingerprint: print(o),
                        outcome,
                    },
                });
                assert_eq!(got, want, "step {step}: inspection of {at}");
            }
        }
    }
}

macro_rules! contract {
    ($backend:ident, $make:expr) => {
        mod $backend {
            use super::*;

            macro_rules! case {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let (store, _keep) = $make;
                        super::$name(store).await;
                    }
                };
            }

            case!(claim_race_has_one_winner);
            case!(completion_is_replayed_with_its_fingerprint);
            case!(outcomes_without_a_body_round_trip);
            case!(a_mismatch_is_reported_with_the_first_fingerprint);
            case!(records_expire_after_their_ttl);
            case!(refresh_on_replay_restarts_the_ttl);
            case!(refresh_on_replay_leaves_other_outcomes_to_expire);
            case!(a_claim_that_finds_its_own_claim_is_claimed);
            case!(release_frees_the_key_for_its_owner_only);
            case!(an_owner_whose_lease_ran_out_cannot_touch_its_successor);
            case!(a_completion_after_its_lease_ran_out_keeps_the_answer);
            case!(renewal_keeps_a_claim_past_its_first_lease);
            case!(waiters_wake_on_completion_and_release);
            case!(waiting_is_bounded_and_immediate_when_nothing_is_in_flight);
            case!(operators_inspect_and_purge_any_record);
            case!(a_lease_that_runs_out_ends_a_wait_without_a_spin);
            case!(random_operations_agree_with_a_model);
        }
    };
}

contract!(memory, (Arc::new(MemoryStore::new(1 << 20)) as Arc<dyn Store>, ()));
contract!(redis, {
    let server = support::redis::RedisServer::start();
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    (Arc::new(store) as Arc<dyn Store>, server)
});
contract!(redis_cluster, {
    let cluster = support::redis::RedisCluster::start();
    let store = RedisStore::cluster(&cluster.urls(), "idemgate", Duration::from_secs(2)).unwrap();
    (Arc::new(store) as Arc<dyn Store>, cluster)
});
contract!(embedded, {
    let dir = support::scratch();
    let store = EmbeddedStore::open(&dir.path().join("contract.redb")).unwrap();
    (Arc::new(store) as Arc<dyn Store>, dir)
});

#[tokio::test]
async fn memory_sweeps_expired_records_and_holds_its_budget() {
    let body: &'static str = Box::leak("x".repeat(1000).into_boxed_str());
    let ttl = Duration::from_millis(300);
    // What one such record costs, as the store counts it.
    let one = {
        let probe = MemoryStore::new(u64::MAX);
        let (k, owner) = (key(), Owner::new());
        probe.claim(&k, &A, owner, LONG, None).await.unwrap();
        probe.complete(&k, &A, owner, response(body), ttl).await.unwrap();
        probe.stored_bytes()
    };
    // Room for twenty records in each of the sixteen shards.
    let budget = 16 * 20 * one;
    let store = MemoryStore::new(budget as u64);
    let mut last = key();
    for _ in 0..1000 {
        last = key();
        let owner = Owner::new();
        store.claim(&last, &A, owner, LONG, None).await.unwrap();
        store.complete(&last, &A, owner, response(body), ttl).await.unwrap();
        assert!(store.stored_bytes() <= budget);
    }
    // The newest record is never the one evicted.
    assert!(matches!(
        store.inspect(&last).await.unwrap(),
        Some((Record::Completed { .. }, _))
    ));
    // A shard over its budget evicts a batch of up to eight, so it keeps at
    // least 21 - 8 records once it has had 21 (each shard gets about 62 of
    // the thousand keys): the store holds records, not just its budget.
    assert!(
        store.stored_bytes() >= 16 * 13 * one,
        "{} bytes kept, records of {one}",
        store.stored_bytes()
    );
    // The sweeper runs every 500 ms; on a loaded machine (the other
    // contract tests start Redis clusters beside this one) a run may come
    // late, so wait for it a while rather than a fixed time.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while store.stored_bytes() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(store.stored_bytes(), 0, "the sweeper removed expired records");
}

/// The model's books hold across restarts of the embedded store: every
/// answer and claim it acknowledged is there when the file is opened again,
/// from the log alone, and (once, after a pause longer than the checkpoint
/// interval of five seconds) from the file and the log together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_keeps_the_books_across_restarts() {
    let dir = support::scratch();
    let path = dir.path().join("restarts.redb");
    let reopen = |path: &std::path::Path| {
        // Once the last store on it has let go of the file.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match EmbeddedStore::open(path) {
                Ok(store) => return Arc::new(store) as Arc<dyn Store>,
                Err(error) if std::time::Instant::now() > deadline => panic!("cannot reopen: {error}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    };
    let store = reopen(&path);
    operations_agree_with_a_model(store, |step, store| {
        if step % 50 == 49 {
            if step == 199 {
                std::thread::sleep(Duration::from_millis(5500));
            }
            drop(store);
            reopen(&path)
        } else {
            store
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_sweeps_expired_records_from_the_file() {
    let dir = support::scratch();
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("sweep.redb")).unwrap());
    let writes: Vec<_> = (0..6000)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let (k, owner) = (key(), Owner::new());
                store.claim(&k, &A, owner, LONG, None).await.unwrap();
                store
                    .complete(&k, &A, owner, response("x"), Duration::from_millis(200))
                    .await
                    .unwrap();
            })
        })
        .collect();
    for write in writes {
        write.await.unwrap();
    }
    assert!(store.records().unwrap() > 0);
    // Expired records leave the log's overlay at the next checkpoint (five
    // seconds on the embedded store), then the file at the next sweep.
    let deadline = Instant::now() + Duration::from_secs(15);
    while store.records().unwrap() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} records never swept",
            store.records().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two deployments on one Redis under different `store.key_prefix`es
/// share no record: the same record key is claimed, completed and
/// replayed in each apart, under `<prefix>:{...}`; and a Redis user whose
/// keys are limited to its prefix (`~orders:*`) runs the store, the
/// readiness probe included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_deployments_under_different_key_prefixes_share_nothing() {
    let server = support::redis::RedisServer::start();
    server
        .cli(&[
            "acl",
            "setuser",
            "orders",
            "on",
            ">pw",
            "~orders:*",
            "&idemgate:done",
            "+@all",
        ])
        .unwrap();
    let limited = server.url().replace("redis://", "redis://orders:pw@");
    let orders = RedisStore::single(&limited, "orders", Duration::from_secs(2)).unwrap();
    let billing = RedisStore::single(&server.url(), "billing", Duration::from_secs(2)).unwrap();
    orders.ping().await.unwrap();
    let k = key();
    for (store, body) in [(&orders, "orders"), (&billing, "billing")] {
        let owner = Owner::new();
        assert_eq!(store.claim(&k, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
        assert!(store.complete(&k, &A, owner, response(body), LONG).await.unwrap());
    }
    for (store, body) in [(&orders, "orders"), (&billing, "billing")] {
        let replay = store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap();
        assert_eq!(
            replay,
            Claim::Completed {
                fingerprint: A,
                outcome: response(body)
            }
        );
    }
    let hex: String = k.0.iter().map(|b| format!("{b:02x}")).collect();
    let mut keys: Vec<String> = server
        .cli(&["--raw", "keys", "*"])
        .unwrap()
        .lines()
        .map(str::to_owned)
        .filter(|name| name.ends_with(&format!("{{{hex}}}")))
        .collect();
    keys.sort();
    assert_eq!(keys, [format!("billing:{{{hex}}}"), format!("orders:{{{hex}}}")]);
    // Its user may not touch another prefix's keys.
    let outside = RedisStore::single(&limited, "idemgate", Duration::from_secs(2)).unwrap();
    assert!(outside.claim(&key(), &A, Owner::new(), LONG, None).await.is_err());
}

/// A Redis out of memory (`maxmemory` under `noeviction`) with room for a
/// claim but not for its answer: the completion is refused, and for a
/// few seconds no new claim is taken (a request whose answer cannot be
/// kept does not reach the backend), the store is not ready, and a record
/// already there is still replayed. That answer's own retries, refused
/// as long as it does not fit, do not keep new claims out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_out_of_memory_takes_no_new_claim_and_still_replays() {
    let server = support::redis::RedisServer::start_with_args(&["--maxmemory-policy", "noeviction"]);
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    let (kept, owner) = (key(), Owner::new());
    assert_eq!(store.claim(&kept, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
    assert!(store.complete(&kept, &A, owner, response("kept"), LONG).await.unwrap());
    let info = server.cli(&["info", "memory"]).unwrap();
    let used: u64 = info
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("used_memory");
    server
        .cli(&["config", "set", "maxmemory", &(used + 256 * 1024).to_string()])
        .unwrap();
    // A claim fits; its 2 MB answer does not.
    let (big, owner) = (key(), Owner::new());
    assert_eq!(store.claim(&big, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
    let body = Bytes::from(vec![b'x'; 2 << 20]);
    let answer = || {
        Outcome::Response(Arc::new(StoredResponse::new(
            StatusCode::CREATED,
            &[],
            std::slice::from_ref(&body),
        )))
    };
    let refused = store.complete(&big, &A, owner, answer(), LONG).await;
    assert!(refused.is_err(), "{refused:?}");
    // Once Redis has let go of the refused command's buffer, a small
    // write fits again; the completion, tried again (as the proxy does
    // every two seconds at most), still does not.
    let deadline = Instant::now() + Duration::from_secs(20);
    while server
        .cli(&["set", "small", "x"])
        .is_none_or(|answer| !answer.contains("OK"))
    {
        assert!(Instant::now() < deadline, "Redis never took a small write again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused = store.complete(&big, &A, owner, answer(), LONG).await;
    assert!(refused.is_err(), "{refused:?}");
    let next = store.claim(&key(), &A, Owner::new(), LONG, None).await;
    assert!(
        matches!(&next, Err(StoreError::NotSent(why)) if why.to_string().contains("out of memory")),
        "{next:?}"
    );
    assert!(store.ping().await.is_err());
    let replay = store.claim(&kept, &A, Owner::new(), LONG, None).await.unwrap();
    assert_eq!(
        replay,
        Claim::Completed {
            fingerprint: A,
            outcome: response("kept")
        }
    );
    // Over its limit, Redis refuses a waiter's mark too: the wait reads the
    // record instead, and a replay is still answered.
    let limit = server.cli(&["config", "get", "maxmemory"]).unwrap();
    let limit = limit.lines().nth(1).expect("the limit").trim().to_owned();
    server.cli(&["config", "set", "maxmemory", "1"]).unwrap();
    store.wait(&big, Duration::from_millis(300)).await.unwrap();
    let replay = store.claim(&kept, &A, Owner::new(), LONG, None).await.unwrap();
    assert!(matches!(replay, Claim::Completed { .. }), "{replay:?}");
    server.cli(&["config", "set", "maxmemory", &limit]).unwrap();
    // The one answer too large for the room left, refused on each try,
    // keeps new claims out for a few seconds only: others fit.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let refused = store.complete(&big, &A, owner, answer(), LONG).await;
        assert!(refused.is_err(), "{refused:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(claim) = store.claim(&key(), &A, Owner::new(), LONG, None).await {
            assert_eq!(claim, Claim::Claimed);
            break;
        }
        assert!(Instant::now() < deadline, "new claims stayed refused");
    }
    store.ping().await.unwrap();
    // Room again: the completion lands.
    server.cli(&["config", "set", "maxmemory", "0"]).unwrap();
    assert!(store.complete(&big, &A, owner, answer(), LONG).await.unwrap());
    assert_eq!(
        store.claim(&key(), &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Claimed
    );
}

/// Completions nobody waits on cost Redis no PUBLISH; a waited-on one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_announces_only_records_someone_waits_on() {
    use futures_util::StreamExt;
    let server = support::redis::RedisServer::start();
    let store = Arc::new(RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap());
    let mut pubsub = ::redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.subscribe("idemgate:done").await.unwrap();

    let (unwatched, owner) = (key(), Owner::new());
    store.claim(&unwatched, &A, owner, LONG, None).await.unwrap();
    assert!(
        store
            .complete(&unwatched, &A, owner, response("x"), LONG)
            .await
            .unwrap()
    );

    let (watched, owner) = (key(), Owner::new());
    store.claim(&watched, &A, owner, LONG, None).await.unwrap();
    let waiter = tokio::spawn({
        let store = store.clone();
        async move { store.wait(&watched, Duration::from_secs(10)).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(store.complete(&watched, &A, owner, response("x"), LONG).await.unwrap());
    waiter.await.unwrap();

    let mut messages = pubsub.on_message();
    let first = tokio::time::timeout(Duration::from_secs(2), messages.next())
        .await
        .expect("the waited-on completion is announced")
        .unwrap();
    let payload = first.get_payload_bytes().to_vec();
    assert!(
        String::from_utf8(payload)
            .unwrap()
            .contains(&hex::encode(&watched.0[..8])),
        "the first announcement is the waited-on record"
    );
    let more = tokio::time::timeout(Duration::from_millis(300), messages.next()).await;
    assert!(more.is_err(), "nothing else was announced");
}

/// A waiter's own steps (reading and marking the record) have the store's
/// deadline on top of the wait: a Redis that stops answering costs the
/// waiter that much, not the time TCP takes to give up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_hangs_costs_a_waiter_no_more_than_the_deadline() {
    let server = support::redis::RedisServer::start();
    let redis = Arc::new(RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap());
    let store = StoreHandle::new(redis, Duration::from_millis(500));
    let (k, owner) = (key(), Owner::new());
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    assert!(server.cli(&["client", "pause", "4000", "all"]).is_some());
    let started = Instant::now();
    let waited = store.wait(&k, Duration::from_secs(1)).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(waited, Err(StoreError::Timeout(_))),
        "{waited:?} after {elapsed:?}"
    );
    assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
}

/// Completions made in one turn of a thread's runtime go to Redis in one
/// script call, and each is still checked against its own owner.
#[tokio::test]
async fn redis_completions_made_together_go_in_one_call_each_owner_checked() {
    let server = support::redis::RedisServer::start();
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    let claims: Vec<_> = (0..8).map(|_| (key(), Owner::new())).collect();
    for (k, owner) in &claims {
        store.claim(k, &A, *owner, LONG, None).await.unwrap();
    }
    assert!(server.cli(&["config", "resetstat"]).is_some());
    // Every other completion comes from a stranger to the claim.
    let done = futures_util::future::join_all(claims.iter().enumerate().map(|(i, (k, owner))| {
        let owner = if i % 2 == 0 { *owner } else { Owner::new() };
        store.complete(k, &A, owner, response("x"), LONG)
    }))
    .await;
    for (i, done) in done.into_iter().enumerate() {
        assert_eq!(done.unwrap(), i % 2 == 0, "completion {i}");
    }
    // A key whose claim is gone (its lease ran out) and nobody claimed
    // since, in a batch with one owned: the answer is kept there too.
    let (gone, owned) = (key(), Owner::new());
    let last = (key(), Owner::new());
    store.claim(&last.0, &A, last.1, LONG, None).await.unwrap();
    let (kept, done) = tokio::join!(
        store.complete(&gone, &A, owned, response("x"), LONG),
        store.complete(&last.0, &A, last.1, response("x"), LONG),
    );
    assert!(kept.unwrap());
    assert!(done.unwrap());
    assert!(matches!(
        store.claim(&gone, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed { .. }
    ));
    let stats = server.cli(&["info", "commandstats"]).unwrap();
    let field = |command: &str, name: &str| command_stat(&stats, command, name);
    let ran = |command: &str| field(command, "calls=") - field(command, "failed_calls=");
    // A fresh server refuses the first EVALSHA (NOSCRIPT), and the script
    // is then sent whole: one call went through.
    assert_eq!(field("evalsha", "failed_calls="), 1, "{stats}");
    assert_eq!(ran("evalsha") + ran("eval"), 2, "{stats}");
    for (i, (k, _)) in claims.iter().enumerate() {
        match store.claim(k, &A, Owner::new(), LONG, None).await.unwrap() {
            Claim::Completed { .. } => assert_eq!(i % 2, 0, "{i} completed by a stranger"),
            Claim::InFlight { .. } => assert_eq!(i % 2, 1, "{i} not completed"),
            Claim::Claimed => panic!("{i}: the claim was lost"),
        }
    }
    // Two completions of one key with no record in one call: as one after
    // the other, the second finds the first's record.
    let twice = key();
    let (first, second) = tokio::join!(
        store.complete(&twice, &A, Owner::new(), response("first"), LONG),
        store.complete(&twice, &B, Owner::new(), response("second"), LONG),
    );
    assert_eq!((first.unwrap(), second.unwrap()), (true, false));
    assert_eq!(
        store.claim(&twice, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed {
            fingerprint: A,
            outcome: response("first")
        }
    );
}

/// The field `name` (`calls=`, `failed_calls=`) of `command` in the
/// server's `INFO commandstats` `stats`.
fn command_stat(stats: &str, command: &str, name: &str) -> u64 {
    let line = stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{command}:")))
        .unwrap_or_default();
    let value = line.split([':', ',']).find_map(|f| f.strip_prefix(name)).unwrap_or("0");
    value.parse().unwrap()
}

/// Retries of one request claimed at once from one thread (a storm of a
/// client's retries) share one claim's round trip: Redis reads a stored
/// answer once for them all, not once each, and each is told what a claim
/// of its own would have found. A waiter reads whether the record is in
/// flight, not the answer in it.
#[tokio::test]
async fn redis_claims_of_one_request_at_once_read_its_record_once() {
    let server = support::redis::RedisServer::start();
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    let answer = Outcome::Response(Arc::new(StoredResponse::new(
        StatusCode::CREATED,
        &[],
        &[Bytes::from(vec![b'x'; 1 << 20])],
    )));
    let (k, owner) = (key(), Owner::new());
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    assert!(store.complete(&k, &A, owner, answer.clone(), LONG).await.unwrap());
    let sets = || command_stat(&server.cli(&["info", "commandstats"]).unwrap(), "set", "calls=");
    let before = sets();
    let replays = futures_util::future::join_all((0..50).map(|_| store.claim(&k, &A, Owner::new(), LONG, None))).await;
    for replay in replays {
        assert_eq!(
            replay.unwrap(),
            Claim::Completed {
                fingerprint: A,
                outcome: answer.clone()
            }
        );
    }
    assert_eq!(sets() - before, 1, "50 claims at once, one read");

    // Another body on the key at the same time is claimed by itself.
    let before = sets();
    let (same, other) = tokio::join!(
        store.claim(&k, &A, Owner::new(), LONG, None),
        store.claim(&k, &B, Owner::new(), LONG, None),
    );
    for found in [same.unwrap(), other.unwrap()] {
        assert!(matches!(found, Claim::Completed { fingerprint: A, .. }), "{found:?}");
    }
    assert_eq!(sets() - before, 2);

    // Claims of a free key at once: one takes it, the others are told of
    // its claim.
    let free = key();
    let claims =
        futures_util::future::join_all((0..10).map(|_| store.claim(&free, &A, Owner::new(), LONG, None))).await;
    let claims: Vec<_> = claims.into_iter().map(Result::unwrap).collect();
    assert_eq!(claims.iter().filter(|c| **c == Claim::Claimed).count(), 1, "{claims:?}");
    assert_eq!(
        claims
            .iter()
            .filter(|c| **c == Claim::InFlight { fingerprint: A })
            .count(),
        9,
        "{claims:?}"
    );

    // The claim joined is given up before its answer (its client hung
    // up): the one that joined it sends its own.
    let gone = key();
    let mut first = Box::pin(store.claim(&gone, &A, Owner::new(), LONG, None));
    assert!(futures_util::poll!(first.as_mut()).is_pending());
    let mut second = Box::pin(store.claim(&gone, &A, Owner::new(), LONG, None));
    assert!(futures_util::poll!(second.as_mut()).is_pending());
    drop(first);
    let found = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("a claim that joined one given up is answered")
        .unwrap();
    assert!(
        matches!(found, Claim::Claimed | Claim::InFlight { fingerprint: A }),
        "{found:?}"
    );

    // A record that cannot be read is so for each claim that joined.
    let unreadable = key();
    let redis_key = format!("idemgate:{{{}}}", hex::encode(unreadable.0));
    assert!(server.cli(&["set", &redis_key, "\u{1}\u{1}garbage"]).is_some());
    let claims =
        futures_util::future::join_all((0..3).map(|_| store.claim(&unreadable, &A, Owner::new(), LONG, None))).await;
    for claim in claims {
        assert!(matches!(claim, Err(StoreError::Corrupt(_))), "{claim:?}");
    }
    // So is a key that holds another type of value, by the native claim
    // and by the script a replay that refreshes its TTL claims with.
    let other_type = key();
    let redis_key = format!("idemgate:{{{}}}", hex::encode(other_type.0));
    assert!(server.cli(&["hset", &redis_key, "f", "v"]).is_some());
    for refresh in [None, Some(LONG)] {
        let claim = store.claim(&other_type, &A, Owner::new(), LONG, refresh).await;
        assert!(matches!(claim, Err(StoreError::Corrupt(_))), "{claim:?}");
    }

    // A waiter on the completed record reads a few bytes of it.
    let output = || -> u64 {
        let stats = server.cli(&["info", "stats"]).unwrap();
        let line = stats
            .lines()
            .find(|l| l.starts_with("total_net_output_bytes:"))
            .unwrap();
        line.trim()["total_net_output_bytes:".len()..].parse().unwrap()
    };
    let before = output();
    store.wait(&k, Duration::from_secs(1)).await.unwrap();
    let read = output() - before;
    assert!(read < 10_000, "a waiter read {read} bytes");
}

/// A claim dropped before its answer (its client hung up) is seen
/// through: released if the store took it, left alone if it found a
/// record, and still answering the claims that joined it.
#[tokio::test]
async fn redis_claims_dropped_before_their_answer_are_seen_through() {
    let server = support::redis::RedisServer::start();
    let redis = Arc::new(RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap());
    let store = StoreHandle::new(redis, Duration::from_secs(2));
    let (done, owner) = (key(), Owner::new());
    assert_eq!(store.claim(&done, &A, owner, LONG, None).await.unwrap(), Claim::Claimed);
    assert!(store.complete(&done, &A, owner, response("x"), LONG).await.unwrap());
    let stats = || server.cli(&["info", "commandstats"]).unwrap();
    let calls = |command: &str| command_stat(&stats(), command, "calls=");
    let (sets, scripts) = (calls("set"), calls("evalsha") + calls("eval"));

    // Found a record: nothing to release. Joined by another, which is
    // answered though the claim it joined was dropped.
    let mut first = Box::pin(store.claim(&done, &A, Owner::new(), LONG, None));
    assert!(futures_util::poll!(first.as_mut()).is_pending());
    let mut second = Box::pin(store.claim(&done, &A, Owner::new(), LONG, None));
    assert!(futures_util::poll!(second.as_mut()).is_pending());
    drop(first);
    assert!(matches!(second.await.unwrap(), Claim::Completed { fingerprint: A, .. }));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(calls("set") - sets, 1, "one claim sent");
    assert_eq!(calls("evalsha") + calls("eval") - scripts, 0, "no release sent");

    // Took a free key: released once answered.
    let free = key();
    let mut dropped = Box::pin(store.claim(&free, &A, Owner::new(), LONG, None));
    assert!(futures_util::poll!(dropped.as_mut()).is_pending());
    drop(dropped);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match store.claim(&free, &A, Owner::new(), LONG, None).await.unwrap() {
            Claim::Claimed => break,
            found => assert!(
                Instant::now() < deadline,
                "the dropped claim still holds the key: {found:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A one-shard cluster behind `url` refuses a script on keys of several
/// hash slots (CROSSSLOT): completions made together are then each
/// completed alone, and from there on sent alone.
#[tokio::test]
async fn redis_in_cluster_mode_behind_one_url_completes_a_batch_one_by_one() {
    let server = support::redis::RedisServer::start_one_shard_cluster();
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    for round in 0..2 {
        let claims: Vec<_> = (0..4).map(|_| (key(), Owner::new())).collect();
        for (k, owner) in &claims {
            store.claim(k, &A, *owner, LONG, None).await.unwrap();
        }
        let done = futures_util::future::join_all(
            claims
                .iter()
                .map(|(k, owner)| store.complete(k, &A, *owner, response("x"), LONG)),
        )
        .await;
        for (i, done) in done.into_iter().enumerate() {
            assert!(done.unwrap(), "round {round}, completion {i}");
        }
        for (k, _) in &claims {
            assert!(matches!(
                store.claim(k, &A, Owner::new(), LONG, None).await.unwrap(),
                Claim::Completed { .. }
            ));
        }
    }
    // One batch was refused; every completion went alone after it.
    let stats = server.cli(&["info", "errorstats"]).unwrap();
    assert!(stats.contains("errorstat_CROSSSLOT:count=1"), "{stats}");
}

/// A node without the scripts (restarted, failed over, or new) while
/// another node is down: the scripts go whole to the node that needs them,
/// so its records can still be completed before their leases run out.
#[tokio::test]
async fn redis_cluster_scripts_reach_a_node_without_them_while_another_is_down() {
    let mut cluster = support::redis::RedisCluster::start_with_args(&["--cluster-require-full-coverage", "no"]);
    cluster.nodes[0].kill();
    let store = RedisStore::cluster(&cluster.urls(), "idemgate", Duration::from_secs(2)).unwrap();
    // A key of a live node: a claim of one on the dead node fails.
    let mut claimed = None;
    for _ in 0..30 {
        let (k, owner) = (key(), Owner::new());
        if store.claim(&k, &A, owner, LONG, None).await.is_ok() {
            claimed = Some((k, owner));
            break;
        }
    }
    let (k, owner) = claimed.expect("a key on one of the two live nodes");
    assert!(store.complete(&k, &A, owner, response("x"), LONG).await.unwrap());
    assert!(matches!(
        store.claim(&k, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed { .. }
    ));
}

/// `store.wait_for_replicas` on a Redis Cluster: a write waits for the
/// replicas of the node that took it. The first and last nodes have a
/// replica (the last serves the slot of the store's probe, which the first
/// claim waits on), the second none: claims of the others' slots are
/// taken, and their replicas hold each; the second's are refused as not
/// copied.
#[tokio::test]
async fn redis_cluster_writes_wait_for_the_replicas_of_their_own_node() {
    let cluster = support::redis::RedisCluster::start();
    let replicas = [cluster.add_replica_of(0), cluster.add_replica_of(2)];
    let timeout = Duration::from_secs(1);
    let copied = RedisStore::cluster_copied(&cluster.urls(), "idemgate", timeout, 1).unwrap();
    let store = StoreHandle::new(Arc::new(copied), timeout);
    // At once, so each node's claims share a batch and its one WAIT.
    let keys: Vec<RecordKey> = (0..24).map(|_| key()).collect();
    let claims = keys.iter().map(|k| store.claim(k, &A, Owner::new(), LONG, None));
    let (mut taken, mut refused) = (0, 0);
    for claim in futures_util::future::join_all(claims).await {
        match claim {
            Ok(Claim::Claimed) => taken += 1,
            Err(StoreError::Unavailable(why)) => {
                let why = why.to_string();
                assert!(why.contains("0 of the 1 replicas"), "{why}");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(taken > 0 && refused > 0, "{taken} taken, {refused} refused");
    let records = |server: &support::redis::RedisServer| {
        let found = server.cli(&["--scan", "--pattern", "idemgate:*"]).unwrap();
        found.lines().count()
    };
    assert_eq!(records(&cluster.nodes[0]) + records(&cluster.nodes[2]), taken);
    assert_eq!(records(&replicas[0]), records(&cluster.nodes[0]));
    assert_eq!(records(&replicas[1]), records(&cluster.nodes[2]));
}

/// A primary that stops answering without closing its connections (a hung
/// process, a paused machine) and is failed over to its replica: claims of
/// its slots go to the new primary within seconds, though the client
/// learns a new slot map only from an error or a redirect, which the
/// stopped node never gives. They got 503 until it came back.
#[tokio::test]
async fn redis_cluster_claims_follow_a_failover_away_from_a_node_that_stopped_answering() {
    let cluster = support::redis::RedisCluster::start();
    let replica = cluster.add_replica_of(0);
    let timeout = Duration::from_millis(500);
    // Behind the store's deadline, as the proxy calls it.
    let store = support::redis::cluster_store_within(&cluster.urls(), timeout);
    // Keys on every node, the stopped one's among them.
    let keys: Vec<RecordKey> = (0..24).map(|_| key()).collect();
    for k in &keys {
        assert!(matches!(
            store.claim(k, &A, Owner::new(), LONG, None).await.unwrap(),
            Claim::Claimed
        ));
    }
    // Replication is asynchronous: a claim the replica has not copied is
    // lost in the failover, as Redis documents. Copied first.
    let offset = |server: &support::redis::RedisServer| {
        let info = server.cli(&["info", "replication"]).unwrap();
        let line = info.lines().find(|l| l.starts_with("master_repl_offset:")).unwrap();
        line.trim_start_matches("master_repl_offset:")
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let written = offset(&cluster.nodes[0]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while offset(&replica) < written {
        assert!(Instant::now() < deadline, "the replica never caught up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.nodes[0].pause();
    let _resume = Resume(&cluster.nodes[0]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !replica.cli(&["role"]).is_some_and(|role| role.starts_with("master")) {
        assert!(Instant::now() < deadline, "the replica never took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Fresh keys, until every one is claimed in a round; then every
    // earlier claim is found.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut failed = 0;
        for _ in 0..24 {
            if store.claim(&key(), &A, Owner::new(), LONG, None).await.is_err() {
                failed += 1;
            }
        }
        if failed == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{failed} of 24 claims still failing 10 s after the failover"
        );
    }
    for k in &keys {
        assert!(matches!(
            store.claim(k, &A, Owner::new(), LONG, None).await.unwrap(),
            Claim::InFlight { .. }
        ));
    }
}

/// A primary that stops answering with no replica to take over: the
/// cluster's nodes still say it serves its slots, so its calls time out
/// on the connection made before, and nothing is made anew. A connection
/// made anew would have no link to it, and try to connect again for each
/// call to its slots: under load, dozens of connections a second.
#[tokio::test]
async fn redis_cluster_calls_to_a_node_that_stopped_answering_open_no_new_connections() {
    let cluster = support::redis::RedisCluster::start();
    let timeout = Duration::from_millis(300);
    let store = support::redis::cluster_store_within(&cluster.urls(), timeout);
    for _ in 0..24 {
        store.claim(&key(), &A, Owner::new(), LONG, None).await.unwrap();
    }
    let stopped = cluster.nodes[0].port;
    // Sockets of this machine to the stopped node, in any state.
    let sockets = || {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let port = format!(":{stopped:04X} ");
        table
            .lines()
            .skip(1)
            .filter(|line| {
                line.split_whitespace()
                    .nth(2)
                    .is_some_and(|remote| format!("{remote} ").contains(&port))
            })
            .count()
    };
    cluster.nodes[0].pause();
    let _resume = Resume(&cluster.nodes[0]);
    let before = sockets();
    let mut failed = 0;
    for _ in 0..10 {
        let keys: Vec<RecordKey> = (0..24).map(|_| key()).collect();
        let claims = keys.iter().map(|k| store.claim(k, &A, Owner::new(), LONG, None));
        failed += futures_util::future::join_all(claims)
            .await
            .iter()
            .filter(|c| c.is_err())
            .count();
    }
    assert!(failed > 0, "no claim reached the stopped node");
    let after = sockets();
    assert!(
        after <= before + 4,
        "{before} sockets to the stopped node before, {after} after {failed} calls to it"
    );
}

/// A node that hangs holds up the calls for its own slots only, even as
/// the slot map changes meanwhile (here a slot moves between two other
/// nodes, and its next call is redirected): the redis crate's cluster
/// client, used before, rebuilt its map on the redirect and, waiting out
/// the hung node as it did, stalled every call for a second or more, so
/// calls for healthy nodes failed too.
#[tokio::test]
async fn redis_cluster_calls_to_other_nodes_go_on_while_one_hangs_and_a_slot_moves() {
    let cluster = support::redis::RedisCluster::start();
    let timeout = Duration::from_millis(500);
    let store = support::redis::cluster_store_within(&cluster.urls(), timeout);
    let mut keyslot = ::redis::Client::open(cluster.nodes[0].url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut slot_of = |k: &RecordKey| -> u16 {
        let name = format!("idemgate:{{{}}}", hex::encode(k.0));
        ::redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(name)
            .query(&mut keyslot)
            .unwrap()
    };
    // As `redis-cli --cluster create` splits the slots of three nodes.
    let node_of = |slot: u16| match slot {
        0..=5460 => 0,
        5461..=10922 => 1,
        _ => 2,
    };
    // A key of the first node whose slot will move to the third, and keys
    // of those two nodes in other slots.
    let (moved, slot) = loop {
        let k = key();
        let slot = slot_of(&k);
        if node_of(slot) == 0 {
            break (k, slot);
        }
    };
    let others: Vec<RecordKey> = std::iter::repeat_with(key)
        .filter(|k| {
            let s = slot_of(k);
            node_of(s) != 1 && s != slot
        })
        .take(240)
        .collect();
    // The map and a connection to each node, before.
    for k in &others[..24] {
        store.claim(k, &A, Owner::new(), LONG, None).await.unwrap();
    }
    cluster.nodes[1].pause();
    let _resume = Resume(&cluster.nodes[1]);
    let id = |n: usize| cluster.nodes[n].cli(&["cluster", "myid"]).unwrap().trim().to_owned();
    let (from, to) = (id(0), id(2));
    let slot = slot.to_string();
    cluster.nodes[2]
        .cli(&["cluster", "setslot", &slot, "importing", &from])
        .unwrap();
    cluster.nodes[0]
        .cli(&["cluster", "setslot", &slot, "migrating", &to])
        .unwrap();
    cluster.nodes[2]
        .cli(&["cluster", "setslot", &slot, "node", &to])
        .unwrap();
    cluster.nodes[0]
        .cli(&["cluster", "setslot", &slot, "node", &to])
        .unwrap();
    // Sent to the first node, as the map says, and redirected.
    assert!(matches!(
        store.claim(&moved, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Claimed
    ));
    // For about two seconds, as the map is asked for again.
    let mut failed = Vec::new();
    for batch in others[24..].chunks(12) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let claims = batch.iter().map(|k| store.claim(k, &A, Owner::new(), LONG, None));
        for claim in futures_util::future::join_all(claims).await {
            if let Err(error) = claim {
                failed.push(error.to_string());
            }
        }
    }
    assert!(failed.is_empty(), "{} of 216 claims failed: {failed:?}", failed.len());
}

/// A release that outlives its deadline (Redis stalled, as when its claim
/// went unanswered) still lands once Redis answers, though Redis lost its
/// scripts meanwhile (a restart, a failover): sent by its hash, it was
/// answered NOSCRIPT with nobody left to send it whole, and the key stayed
/// claimed for its lease (a probe saw 48 keys so after a pause).
#[tokio::test]
async fn redis_a_late_release_lands_on_a_server_that_lost_the_script() {
    let server = support::redis::RedisServer::start();
    let redis = Arc::new(RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap());
    let store = StoreHandle::new(redis, Duration::from_millis(300));
    let (k, owner) = (key(), Owner::new());
    store.claim(&k, &A, owner, LONG, None).await.unwrap();
    server.cli(&["script", "flush"]).unwrap();
    server.cli(&["client", "pause", "1000", "all"]).unwrap();
    assert!(matches!(store.release(&k, owner).await, Err(StoreError::Timeout(_))));
    let deadline = Instant::now() + Duration::from_secs(5);
    while server
        .cli(&["exists", &format!("idemgate:{{{}}}", hex::encode(k.0))])
        .unwrap()
        .trim()
        != "0"
    {
        assert!(Instant::now() < deadline, "the claim was never released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Resumes a paused server when dropped, as a failed assertion unwinds.
struct Resume<'a>(&'a support::redis::RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.resume();
    }
}

/// A write Redis refuses (here a TTL it cannot take) fails that completion
/// alone, not the others sent with it.
#[tokio::test]
async fn redis_refusing_one_completion_of_a_batch_fails_it_alone() {
    let server = support::redis::RedisServer::start();
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    let (good, bad) = ((key(), Owner::new()), (key(), Owner::new()));
    for (k, owner) in [&good, &bad] {
        store.claim(k, &A, *owner, LONG, None).await.unwrap();
    }
    let (done, refused) = tokio::join!(
        store.complete(&good.0, &A, good.1, response("x"), LONG),
        store.complete(&bad.0, &A, bad.1, response("x"), Duration::MAX),
    );
    assert!(done.unwrap());
    assert!(refused.is_err(), "{refused:?}");
    assert!(matches!(
        store.claim(&good.0, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::Completed { .. }
    ));
    assert!(matches!(
        store.claim(&bad.0, &A, Owner::new(), LONG, None).await.unwrap(),
        Claim::InFlight { .. }
    ));
}

/// A URL's user, password and database: each connection logs in and
/// selects that database before anything else, and a wrong password is an
/// error the store reports at once, not a hang.
#[tokio::test]
async fn redis_connections_log_in_and_select_the_urls_database() {
    let server =
        support::redis::RedisServer::start_with_args(&["--user", "gate", "on", ">s3cret", "~*", "&*", "+@all"]);
    let url = format!("redis://gate:s3cret@127.0.0.1:{}/3", server.port);
    let store = RedisStore::single(&url, "idemgate", Duration::from_secs(2)).unwrap();
    let (k, owner) = (key(), Owner::new());
    assert!(matches!(
        store.claim(&k, &A, owner, LONG, None).await.unwrap(),
        Claim::Claimed
    ));
    assert!(store.complete(&k, &A, owner, response("x"), LONG).await.unwrap());
    assert_eq!(server.cli(&["-n", "3", "dbsize"]).unwrap().trim(), "1");
    assert_eq!(server.cli(&["-n", "0", "dbsize"]).unwrap().trim(), "0");

    let wrong = format!("redis://gate:wrong@127.0.0.1:{}/3", server.port);
    let store = RedisStore::single(&wrong, "idemgate", Duration::from_secs(2)).unwrap();
    let started = Instant::now();
    let refused = store.claim(&key(), &A, Owner::new(), LONG, None).await;
    assert!(matches!(refused, Err(StoreError::NotSent(_))), "{refused:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
}

/// A server that turns a connection away as it accepts it (its client
/// limit reached) makes that claim unavailable and nothing more: once it
/// takes connections again, claims go on by the native `SET ... NX GET`.
/// Its refusal read as the answer to that `SET` would switch the store to
/// the claim script for good.
#[tokio::test]
async fn redis_turning_a_connection_away_leaves_the_native_claim_in_use() {
    use std::io::{Read, Write};
    let server = support::redis::RedisServer::start();
    server.cli(&["config", "set", "maxclients", "1"]).unwrap();
    let mut only = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    only.write_all(b"PING\r\n").unwrap();
    let mut pong = [0u8; 7];
    only.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"+PONG\r\n");

    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(2)).unwrap();
    let refused = store.claim(&key(), &A, Owner::new(), LONG, None).await;
    assert!(matches!(refused, Err(StoreError::NotSent(_))), "{refused:?}");
    drop(only);
    let deadline = Instant::now() + Duration::from_secs(5);
    while server
        .cli(&["config", "set", "maxclients", "100"])
        .as_deref()
        .map(str::trim)
        != Some("OK")
    {
        assert!(Instant::now() < deadline, "redis-cli never got in");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The refused connect backs off (25 ms): claims meanwhile are not sent.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match store.claim(&key(), &A, Owner::new(), LONG, None).await {
            Ok(Claim::Claimed) => break,
            Err(StoreError::NotSent(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => panic!("{other:?}"),
        }
    }
    // That first claim ran the scripts' probe first, as a claim does until
    // it has run (a user denied scripts takes no claim); all are native.
    server.cli(&["config", "resetstat"]).unwrap();
    for _ in 0..2 {
        let claimed = store.claim(&key(), &A, Owner::new(), LONG, None).await;
        assert!(matches!(claimed, Ok(Claim::Claimed)), "{claimed:?}");
    }
    let stats = server.cli(&["info", "commandstats"]).unwrap();
    assert!(stats.contains("cmdstat_set:calls=2,"), "{stats}");
    assert!(!stats.contains("cmdstat_eval"), "{stats}");
}

/// Many commands in flight on one thread's connection, with records larger
/// than a socket's buffers, so both ways are cut into many writes and
/// reads: each command still gets its own answer.
#[tokio::test]
async fn redis_gives_each_of_many_large_commands_in_flight_its_own_answer() {
    let server = support::redis::RedisServer::start();
    let store = RedisStore::single(&server.url(), "idemgate", Duration::from_secs(5)).unwrap();
    let records: Vec<(RecordKey, Owner, Bytes)> = (0..48)
        .map(|i| {
            (
                key(),
                Owner::new(),
                Bytes::from(format!("{i:02}.").repeat(20_000 + 1_000 * i)),
            )
        })
        .collect();
    let outcome = |body: &Bytes| {
        Outcome::Response(Arc::new(StoredResponse::new(
            StatusCode::OK,
            &[],
            std::slice::from_ref(body),
        )))
    };
    let claimed = futures_util::future::join_all(
        records
            .iter()
            .map(|(k, owner, _)| store.claim(k, &A, *owner, LONG, None)),
    )
    .await;
    assert!(claimed.iter().all(|c| matches!(c, Ok(Claim::Claimed))), "{claimed:?}");
    let completed = futures_util::future::join_all(
        records
            .iter()
            .map(|(k, owner, body)| store.complete(k, &A, *owner, outcome(body), LONG)),
    )
    .await;
    assert!(completed.iter().all(|c| matches!(c, Ok(true))), "{completed:?}");
    let found = futures_util::future::join_all(
        records
            .iter()
            .map(|(k, _, _)| store.claim(k, &A, Owner::new(), LONG, None)),
    )
    .await;
    for ((_, _, body), found) in records.iter().zip(found) {
        match found.unwrap() {
            Claim::Completed {
                fingerprint,
                outcome: Outcome::Response(stored),
            } => {
                assert_eq!(fingerprint, A);
                assert_eq!(stored.body(), body);
            }
            other => panic!("{other:?}"),
        }
    }
}
