//! Binding a worker process, and what it starts, to one CPU: the CPUs this process may use, the binding itself, and a
//! claim on a CPU that the other kvsim workers of the machine see (so that runs side by side, pytest-xdist's
//! or two campaigns', do not bind their workers to the same CPUs while others sit idle).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

/// The CPUs this process may run on, in increasing order: its affinity mask on Linux (which `taskset`, cgroup
/// cpusets and Slurm's bindings narrow); empty elsewhere, or when it cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bit mask owned here, of the size given; the call only writes into it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } == 0 {
            return (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect();
        }
    }
    vec![]
}

/// Binds the calling thread to CPU `cpu` (Linux; elsewhere an `Unsupported` error). What it starts afterwards (a
/// thread, an engine process and that process's threads) inherits the binding; threads already running keep theirs.
pub fn pin_to_cpu(cpu: usize) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("no CPU {cpu}")));
        }
        // SAFETY: as in `allowed_cpus`; the set is read by the call, which changes only this thread's affinity.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        unsafe { libc::CPU_SET(cpu, &mut set) };
        if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } == 0 {
            return Ok(());
        }
        Err(std::io::Error::last_os_error())
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, format!("cannot pin to CPU {cpu} here")))
    }
}

/// A CPU held by this process: an exclusive lock on its claim file, released when the claim is dropped or, however
/// the process ends, by the kernel.
#[derive(Debug)]
pub struct CpuClaim {
    pub cpu: usize,
    _lock: File,
}

/// Where the machine's claims are (`<temp>/kvsim-cpu-claims`, one `cpu-N.lock` per CPU).
pub fn claims_dir() -> PathBuf {
    std::env::temp_dir().join("kvsim-cpu-claims")
}

/// Claims the first CPU of `allowed` that no other holder has claimed, trying `preferred` first and then the next ones
/// in order, round: an exclusive `flock` on `dir/cpu-N.lock`. `Ok(None)`: every one is held. An error: the claims
/// cannot be kept here (the folder cannot be made, a file cannot be opened).
pub fn claim_cpu(dir: &Path, preferred: usize, allowed: &[usize]) -> std::io::Result<Option<CpuClaim>> {
    if !dir.is_dir() {
        std::fs::create_dir_all(dir)?;
        // Other users' workers claim here too: every user may add a file, none may remove another's.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
        }
    }
    let start = allowed.iter().position(|&c| c == preferred).unwrap_or(0);
    for &cpu in allowed[start..].iter().chain(&allowed[..start]) {
        let path = dir.join(format!("cpu-{cpu}.lock"));
        // A lock needs no write access: another user's claim file is opened for reading.
        let file = match OpenOptions::new().read(true).open(&path) {
            Ok(f) => f,
            Err(_) => OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)?,
        };
        match file.try_lock() {
            Ok(()) => return Ok(Some(CpuClaim { cpu, _lock: file })),
            Err(TryLockError::WouldBlock) => continue,
            Err(TryLockError::Error(e)) => return Err(e),
        }
    }
    Ok(None)
}

/// Claims a CPU in `dir` (preferred first, among those this thread may use: [`claim_cpu`]) and binds the calling
/// thread to it ([`pin_to_cpu`]); the binding holds the claim. `Ok(None)`: every CPU is held, nothing is bound. A
/// claimed CPU that cannot be bound to is released again, and the error names it.
pub fn bind_to_claimed_cpu(dir: &Path, preferred: usize) -> std::io::Result<Option<CpuClaim>> {
    let Some(claim) = claim_cpu(dir, preferred, &allowed_cpus())? else { return Ok(None) };
    pin_to_cpu(claim.cpu).map_err(|e| std::io::Error::new(e.kind(), format!("CPU {}: {e}", claim.cpu)))?;
    Ok(Some(claim))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread pinned to one of the CPUs it may use runs on that one alone afterwards, and so do the threads it
    /// starts; a CPU past the mask's size is a typed error. (Linux: elsewhere nothing can be pinned.)
    #[cfg(target_os = "linux")]
    #[test]
    fn a_pinned_thread_and_its_children_keep_to_their_cpu() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "the affinity mask of a Linux process names at least one CPU");
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
        let last = *cpus.last().unwrap();
        let (mine, child) = std::thread::spawn(move || {
            pin_to_cpu(last).unwrap();
            (allowed_cpus(), std::thread::spawn(allowed_cpus).join().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!((mine, child), (vec![last], vec![last]));
        assert_eq!(allowed_cpus(), cpus, "another thread's binding leaves this one as it was");
        assert_eq!(pin_to_cpu(1 << 20).unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
    }

    /// Claims go to the preferred CPU when it is free, else to the next free one round the list; a held CPU is never
    /// claimed twice, every one held gives none, and a dropped claim frees its CPU.
    #[test]
    fn each_cpu_is_claimed_once_at_a_time_starting_from_the_preferred_one() {
        let dir = std::env::temp_dir().join(format!("kvsim-claims-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let allowed = [2, 5, 7];
        let a = claim_cpu(&dir, 5, &allowed).unwrap().unwrap();
        let b = claim_cpu(&dir, 5, &allowed).unwrap().unwrap();
        let c = claim_cpu(&dir, 5, &allowed).unwrap().unwrap();
        assert_eq!((a.cpu, b.cpu, c.cpu), (5, 7, 2));
        assert!(claim_cpu(&dir, 2, &allowed).unwrap().is_none());
        drop(b);
        assert_eq!(claim_cpu(&dir, 2, &allowed).unwrap().unwrap().cpu, 7);
        // A preferred CPU outside the list starts at its first (2, held by `c`), then goes on to 5, freed by `a`.
        drop(a);
        assert_eq!(claim_cpu(&dir, 9, &allowed).unwrap().unwrap().cpu, 5);
        assert!(claim_cpu(&dir, 0, &[]).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Binding to a claimed CPU leaves the thread on that CPU alone, holding the claim; with every CPU held it binds
    /// nothing. (Linux: elsewhere nothing can be bound.)
    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_bound_to_its_claim_runs_there_and_holds_it() {
        let dir = std::env::temp_dir().join(format!("kvsim-bind-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cpus = allowed_cpus();
        let first = cpus[0];
        let (claim, now) = std::thread::spawn({
            let dir = dir.clone();
            move || {
                let claim = bind_to_claimed_cpu(&dir, first).unwrap().unwrap();
                (claim, allowed_cpus())
            }
        })
        .join()
        .unwrap();
        assert_eq!((claim.cpu, now), (first, vec![first]));
        let others: Vec<CpuClaim> = cpus[1..].iter().map(|&c| claim_cpu(&dir, c, &cpus).unwrap().unwrap()).collect();
        let last = std::thread::spawn({
            let dir = dir.clone();
            move || (bind_to_claimed_cpu(&dir, first).unwrap().is_none(), allowed_cpus())
        })
        .join()
        .unwrap();
        assert_eq!(last, (true, cpus.clone()), "every CPU held: nothing bound");
        drop((claim, others));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
