//! A fixed pool of compute threads for the forward pass.
//!
//! Why not rayon: a decode step of a small model is ~250 parallel regions of a
//! few microseconds each (one per matrix product). rayon's sleep/wake costs a
//! few microseconds per region, which is a tenth of the step. Here the workers
//! spin briefly on a generation counter between regions (as llama.cpp's
//! threads do) and only fall asleep on a condition variable after ~1 ms
//! without work, so an idle node does not burn CPU.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Busy-wait iterations before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 2000;

/// How long an idle worker spins (and yields) before it sleeps.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(2);

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// The current job; only valid while `remaining > 0` for this generation.
    job: Mutex<Option<JobPtr>>,
    generation: AtomicU64,
    remaining: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

/// A lifetime-erased pointer to the job closure. [`ThreadPool::run`] does not
/// return before every worker has finished with it, so it never dangles.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (see `run`).
unsafe impl Send for JobPtr {}

/// `n` threads in total: the caller's thread plus `n - 1` workers.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl ThreadPool {
    /// A pool of `threads` threads (at least one: the caller).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            generation: AtomicU64::new(0),
            remaining: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("tessera-compute-{index}"))
                    .spawn(move || worker_loop(&shared, index, threads))
                    .unwrap_or_else(|error| panic!("cannot spawn a compute thread: {error}"))
            })
            .collect();
        Self {
            shared,
            workers,
            threads,
        }
    }

    /// The number of threads a job runs on, the caller's included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job(thread_index, thread_count)` on every thread of the pool and
    /// returns when all have finished. Panics if the job panicked anywhere.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, job: F) {
        if self.threads == 1 {
            job(0, 1);
            return;
        }
        let job_ref: &(dyn Fn(usize, usize) + Sync + '_) = &job;
        // SAFETY: erase the lifetime; we wait below until no worker holds it.
        let ptr = JobPtr(unsafe {
            std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(job_ref)
        });
        *lock(&self.shared.job) = Some(ptr);
        self.shared
            .remaining
            .store(self.threads - 1, Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = lock(&self.shared.sleep_lock);
            self.shared.wake.notify_all();
        }
        let own = catch_unwind(AssertUnwindSafe(|| job(0, self.threads)));
        let mut spins = 0u32;
        while self.shared.remaining.load(Ordering::Acquire) != 0 {
            // Spin briefly (a balanced region ends within microseconds), then
            // yield: with more runnable threads than cores, spinning would
            // keep the very worker we wait for off the CPU.
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *lock(&self.shared.job) = None;
        if let Err(payload) = own {
            std::panic::resume_unwind(payload);
        }
        if self.shared.panicked.swap(false, Ordering::SeqCst) {
            panic!("a compute thread panicked");
        }
    }
}

impl Default for ThreadPool {
    fn default() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _guard = lock(&self.shared.sleep_lock);
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn worker_loop(shared: &Shared, index: usize, threads: usize) {
    let mut seen = 0u64;
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let generation = shared.generation.load(Ordering::Acquire);
            if generation != seen {
                break generation;
            }
            spins = spins.wrapping_add(1);
            if spins > SPINS_BEFORE_YIELD {
                std::thread::yield_now();
            }
            if spins.is_multiple_of(1024) && idle_since.elapsed() > SPIN_BEFORE_SLEEP {
                let mut guard = lock(&shared.sleep_lock);
                shared.sleepers.fetch_add(1, Ordering::SeqCst);
                while shared.generation.load(Ordering::SeqCst) == seen {
                    guard = shared
                        .wake
                        .wait(guard)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                shared.sleepers.fetch_sub(1, Ordering::SeqCst);
                idle_since = Instant::now();
                spins = 0;
            }
            std::hint::spin_loop();
        };
        seen = generation;
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let job = *lock(&shared.job);
        if let Some(JobPtr(job)) = job {
            // SAFETY: `run` keeps the closure alive until `remaining` is 0.
            let job = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| job(index, threads))).is_err() {
                shared.panicked.store(true, Ordering::SeqCst);
            }
        }
        shared.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The contiguous part of `0..len` that thread `index` of `count` works on,
/// with boundaries rounded to multiples of `align` (e.g. SIMD widths).
pub fn split_range(len: usize, index: usize, count: usize, align: usize) -> std::ops::Range<usize> {
    let align = align.max(1);
    let units = len.div_ceil(align);
    let start = (units * index / count * align).min(len);
    let end = (units * (index + 1) / count * align).min(len);
    start..end
}

/// A raw view of a mutable slice that threads of one job write in disjoint
/// parts. Each caller must only touch the part it owns.
#[derive(Clone, Copy)]
pub struct DisjointSlice<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: access is only through `part`, whose contract forbids overlap.
unsafe impl<T: Send> Send for DisjointSlice<T> {}
// SAFETY: as for Send: threads sharing it write disjoint parts only.
unsafe impl<T: Send> Sync for DisjointSlice<T> {}

impl<T> DisjointSlice<T> {
    pub fn new(slice: &mut [T]) -> Self {
        Self {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// # Safety
    /// No two threads may hold overlapping ranges at the same time, and the
    /// original slice must not be used while parts are alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_each_job_once() {
        let pool = ThreadPool::new(3);
        for round in 0..200 {
            let hits = AtomicUsize::new(0);
            let mask = AtomicUsize::new(0);
            pool.run(|index, count| {
                assert_eq!(count, 3);
                hits.fetch_add(1, Ordering::SeqCst);
                mask.fetch_or(1 << index, Ordering::SeqCst);
            });
            assert_eq!(hits.load(Ordering::SeqCst), 3, "round {round}");
            assert_eq!(mask.load(Ordering::SeqCst), 0b111);
        }
    }

    #[test]
    fn workers_wake_after_sleeping() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN_BEFORE_SLEEP * 5);
        let hits = AtomicUsize::new(0);
        pool.run(|_, _| {
            hits.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn split_range_covers_everything_once() {
        for len in [0, 1, 7, 64, 577, 49152] {
            for count in 1..5 {
                let mut covered = 0;
                let mut next = 0;
                for index in 0..count {
                    let range = split_range(len, index, count, 4);
                    assert_eq!(range.start, next);
                    next = range.end;
                    covered += range.len();
                }
                assert_eq!(covered, len);
            }
        }
    }

    #[test]
    fn disjoint_writes_land() {
        let pool = ThreadPool::new(2);
        let mut data = vec![0u32; 1000];
        let view = DisjointSlice::new(&mut data);
        pool.run(|index, count| {
            let range = split_range(1000, index, count, 1);
            // SAFETY: split_range gives disjoint ranges.
            let part = unsafe { view.part(range.clone()) };
            for (offset, value) in part.iter_mut().enumerate() {
                *value = (range.start + offset) as u32;
            }
        });
        assert!(data.iter().enumerate().all(|(i, v)| *v == i as u32));
    }
}
