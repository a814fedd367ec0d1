#!/usr/bin/env bash
# A night of fuzzing in one command: every cargo-fuzz target side by side for HOURS, then each corpus minimized,
# every crash made something to look at, and one report.
#
#   fuzz/overnight.sh [HOURS] [JOBS]        # defaults: 8 hours, 2 fuzzing processes in all
#
# What it does, in order (docs/fuzzing.md says why each step is there):
#  1. checks for cargo-fuzz (and says how to install it), builds every target once (`cargo fuzz build -s none`) and
#     the release `kvsim` binary (for `fuzz-case` and `shrink`);
#  2. runs every target of fuzz/fuzz_targets/ at the same time in libFuzzer's fork mode (`-fork=W`, crashes, OOMs and
#     timeouts recorded and passed over, `-rss_limit_mb`), each into its own corpus fuzz/corpus/TARGET seeded by
#     fuzz/seeds/TARGET; JOBS fuzzing processes are shared out over the targets, `sim_trace` first, at least one each;
#     the memory of each target's whole process tree is sampled every SAMPLE_S seconds;
#  3. minimizes each corpus (libFuzzer's `-merge=1`, as `cargo fuzz cmin` runs it) into a new folder that replaces the
#     old one only when the merge succeeded;
#  4. turns every new crash of `sim_trace` into a trace (`kvsim fuzz-case`) and shrinks it into
#     target/kvsim-failures/; runs every new crash of the parser targets once more with a backtrace and groups them
#     by their panic site and first frames (one line per distinct stack);
#  5. writes fuzz/report.json and fuzz/report.txt. Ctrl-C (or SIGTERM) stops the fuzzers and still writes the report
#     (a second Ctrl-C skips the minimization).
#
# Environment: RSS_LIMIT_MB (4096), TIMEOUT_S (per input, 120), SAMPLE_S (10), TARGETS (space-separated; default all),
# REPORT_DIR (fuzz), SHRINK_BUDGET (3000).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

HOURS=${1:-8}
JOBS=${2:-2}
RSS_LIMIT_MB=${RSS_LIMIT_MB:-4096}
TIMEOUT_S=${TIMEOUT_S:-120}
SAMPLE_S=${SAMPLE_S:-10}
REPORT_DIR=${REPORT_DIR:-fuzz}
SHRINK_BUDGET=${SHRINK_BUDGET:-3000}

die() { echo "overnight: $*" >&2; exit 2; }
[[ $HOURS =~ ^[0-9]+([.][0-9]+)?$ ]] || die "HOURS must be a number of hours (e.g. 8 or 0.25), got '$HOURS'"
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "JOBS must be a positive whole number, got '$JOBS'"
SECONDS_TOTAL=$(awk -v h="$HOURS" 'BEGIN { s = int(h * 3600 + 0.5); if (s < 1) s = 1; print s }')

if ! cargo fuzz --version >/dev/null 2>&1; then
    die "cargo-fuzz is not installed. Install it with:
    cargo install cargo-fuzz --locked
(about 1.5 minutes; it needs no nightly toolchain for the '-s none' builds this script makes)"
fi

if [[ -z ${TARGETS:-} ]]; then
    TARGETS=$(cd fuzz/fuzz_targets && ls ./*.rs | sed 's|^\./||; s|\.rs$||' | sort)
    # The op stream through the simulator first: it is the slowest target and gets the spare processes.
    if grep -qx sim_trace <<<"$TARGETS"; then TARGETS="sim_trace $(grep -vx sim_trace <<<"$TARGETS" | xargs)"; fi
fi
read -r -a T <<<"$TARGETS"
N=${#T[@]}
((N > 0)) || die "no fuzz targets"

RUN_DIR=$ROOT/target/overnight
rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR" "$REPORT_DIR" || die "cannot create $RUN_DIR"
MARK=$RUN_DIR/started
touch "$MARK"
STARTED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)

echo "overnight: building every fuzz target once (cargo fuzz build -s none) and the release kvsim binary"
cargo fuzz build -s none >"$RUN_DIR/build.log" 2>&1 || { tail -30 "$RUN_DIR/build.log" >&2; die "cargo fuzz build failed (log: $RUN_DIR/build.log)"; }
cargo build --release --bin kvsim >>"$RUN_DIR/build.log" 2>&1 || { tail -30 "$RUN_DIR/build.log" >&2; die "cargo build --release failed"; }
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
BIN_DIR=$ROOT/fuzz/target/$TRIPLE/release
KVSIM=$ROOT/target/release/kvsim
# The night runs copies, so that a rebuild of fuzz/target meanwhile cannot change what the fork-mode jobs execute.
mkdir -p "$RUN_DIR/bin"
for t in "${T[@]}"; do
    [[ -x $BIN_DIR/$t ]] || die "no binary for target '$t' in $BIN_DIR"
    cp "$BIN_DIR/$t" "$RUN_DIR/bin/$t" || die "cannot copy $BIN_DIR/$t"
done
BIN_DIR=$RUN_DIR/bin

count_files() { find "$1" -maxdepth 1 -type f 2>/dev/null | wc -l | tr -d ' '; }
count_bytes() { find "$1" -maxdepth 1 -type f -printf '%s\n' 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'; }

# Fuzzing processes per target: JOBS shared out, the remainder to the first targets, at least one each.
declare -A WORKERS PGID PEAK_KB START_FILES START_BYTES
for i in "${!T[@]}"; do
    w=$((JOBS / N + (i < JOBS % N ? 1 : 0)))
    ((w < 1)) && w=1
    WORKERS[${T[$i]}]=$w
done

STOP=0
INTERRUPTS=0
on_signal() {
    INTERRUPTS=$((INTERRUPTS + 1))
    STOP=1
    echo "overnight: interrupted; stopping the fuzzers and writing the report" >&2
}
trap on_signal INT TERM

echo "overnight: ${N} targets for ${SECONDS_TOTAL} s, ${JOBS} processes in all, rss limit ${RSS_LIMIT_MB} MB"
for t in "${T[@]}"; do
    corpus=$ROOT/fuzz/corpus/$t
    mkdir -p "$corpus" "$ROOT/fuzz/artifacts/$t"
    START_FILES[$t]=$(count_files "$corpus")
    START_BYTES[$t]=$(count_bytes "$corpus")
    seeds=()
    [[ -d $ROOT/fuzz/seeds/$t ]] && seeds=("$ROOT/fuzz/seeds/$t")
    # A process group of its own (setsid), so that its whole process tree can be measured and stopped.
    setsid "$BIN_DIR/$t" "$corpus" "${seeds[@]}" \
        -fork="${WORKERS[$t]}" -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 \
        -rss_limit_mb="$RSS_LIMIT_MB" -timeout="$TIMEOUT_S" -max_total_time="$SECONDS_TOTAL" \
        -artifact_prefix="$ROOT/fuzz/artifacts/$t/" -print_final_stats=1 \
        >"$RUN_DIR/$t.log" 2>&1 </dev/null &
    PGID[$t]=$!
    PEAK_KB[$t]=0
    echo "  $t: ${WORKERS[$t]} process(es), corpus fuzz/corpus/$t (${START_FILES[$t]} files), log $RUN_DIR/$t.log"
done

alive() { kill -0 "${PGID[$1]}" 2>/dev/null; }
sample_rss() {
    local t kb
    for t in "${T[@]}"; do
        kb=$(ps -o rss= -s "${PGID[$t]}" 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
        ((kb > PEAK_KB[$t])) && PEAK_KB[$t]=$kb
    done
}

DEADLINE=$(($(date +%s) + SECONDS_TOTAL + 120))
while ((STOP == 0)); do
    sample_rss
    any=0
    for t in "${T[@]}"; do alive "$t" && any=1; done
    ((any == 0)) && break
    if (($(date +%s) > DEADLINE)); then
        echo "overnight: a fuzzer outlived its time by two minutes; stopping it" >&2
        break
    fi
    sleep "$SAMPLE_S" &
    wait $! 2>/dev/null
done

stop_all() {
    local t
    for t in "${T[@]}"; do alive "$t" && kill -INT -- "-${PGID[$t]}" 2>/dev/null; done
    for _ in $(seq 30); do
        local any=0
        for t in "${T[@]}"; do alive "$t" && any=1; done
        ((any == 0)) && return
        sleep 1
    done
    for t in "${T[@]}"; do kill -KILL -- "-${PGID[$t]}" 2>/dev/null; done
}
stop_all
wait 2>/dev/null
INTERRUPTED=$((INTERRUPTS > 0 ? 1 : 0))
ENDED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)

# The last status line of a fork-mode run: "#RUNS: cov: C ft: F corp: K exec/s: E oom/timeout/crash: a/b/c time: Ss".
last_stats() {
    grep -aE '^#[0-9]+: cov: ' "$1" | tail -1
}
field() { # field LINE NAME -> the number after "NAME:" (or "NAME")
    sed -nE "s/.*[ #]$2:? ([0-9]+).*/\1/p" <<<"$1" | head -1
}

json_str() { # a JSON string of $1
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/\\t}
    s=${s//$'\r'/}
    s=${s//$'\n'/\\n}
    printf '"%s"' "$s"
}

declare -A BEFORE_FILES BEFORE_BYTES AFTER_FILES AFTER_BYTES MERGE_NOTE
for t in "${T[@]}"; do
    corpus=$ROOT/fuzz/corpus/$t
    BEFORE_FILES[$t]=$(count_files "$corpus")
    BEFORE_BYTES[$t]=$(count_bytes "$corpus")
    AFTER_FILES[$t]=${BEFORE_FILES[$t]}
    AFTER_BYTES[$t]=${BEFORE_BYTES[$t]}
    MERGE_NOTE[$t]="not minimized"
    if ((INTERRUPTS > 1)); then MERGE_NOTE[$t]="skipped (second interrupt)"; continue; fi
    echo "overnight: minimizing fuzz/corpus/$t (${BEFORE_FILES[$t]} files)"
    new=$RUN_DIR/cmin-$t
    rm -rf "$new" && mkdir -p "$new"
    if "$BIN_DIR/$t" -merge=1 -rss_limit_mb="$RSS_LIMIT_MB" -timeout="$TIMEOUT_S" \
        -artifact_prefix="$RUN_DIR/cmin-artifact-$t-" "$new" "$corpus" >"$RUN_DIR/cmin-$t.log" 2>&1 </dev/null &&
        (($(count_files "$new") > 0 || BEFORE_FILES[$t] == 0)); then
        rm -rf "$corpus.old" && mv "$corpus" "$corpus.old" && mv "$new" "$corpus" && rm -rf "$corpus.old"
        AFTER_FILES[$t]=$(count_files "$corpus")
        AFTER_BYTES[$t]=$(count_bytes "$corpus")
        MERGE_NOTE[$t]="minimized"
    else
        MERGE_NOTE[$t]="merge failed; corpus kept as it was (log: target/overnight/cmin-$t.log)"
    fi
done

# Crashes found by this run (artifacts newer than its start).
declare -A CRASHES OOMS TIMEOUTS SLOW UNIQUE DETAIL
FAILURES_JSON=""
for t in "${T[@]}"; do
    art=$ROOT/fuzz/artifacts/$t
    mapfile -t crashes < <(find "$art" -maxdepth 1 -type f -name 'crash-*' -newer "$MARK" 2>/dev/null | sort)
    OOMS[$t]=$(find "$art" -maxdepth 1 -type f -name 'oom-*' -newer "$MARK" 2>/dev/null | wc -l | tr -d ' ')
    TIMEOUTS[$t]=$(find "$art" -maxdepth 1 -type f -name 'timeout-*' -newer "$MARK" 2>/dev/null | wc -l | tr -d ' ')
    # Inputs slower than libFuzzer's -report_slow_units (10 s), kept for a look; not failures.
    SLOW[$t]=$(find "$art" -maxdepth 1 -type f -name 'slow-unit-*' -newer "$MARK" 2>/dev/null | wc -l | tr -d ' ')
    CRASHES[$t]=${#crashes[@]}
    declare -A seen=()
    DETAIL[$t]=""
    for c in "${crashes[@]}"; do
        if [[ $t == sim_trace ]]; then
            out=$("$KVSIM" fuzz-case "$c" --out "$ROOT/target/kvsim-failures" 2>&1)
            trace=$(grep -oE '[^ ]+\.json' <<<"$out" | tail -1)
            shrunk=""
            key="unknown (fuzz-case: $(tail -1 <<<"$out"))"
            if [[ -n $trace && -f $trace ]]; then
                # The class of a crash: its failing check and the kind of the op it fails at.
                replay=$("$KVSIM" replay "$trace" 2>&1)
                check=$(grep -aoE '^  \[[a-z_/-]+\]' <<<"$replay" | head -1 | tr -d ' ')
                kind=$(sed -nE 's/.*first divergence at op [0-9]+ ([A-Za-z]+).*/\1/p' <<<"$replay" | head -1)
                key="${check:-no failing check now} ${kind:-}"
                if [[ -n ${seen[$key]:-} ]]; then
                    shrunk="as ${seen[$key]}"
                else
                    shrunk=$ROOT/target/kvsim-failures/shrunk-$(basename "$trace")
                    shrunk_out=$("$KVSIM" shrink "$trace" --budget "$SHRINK_BUDGET" --out "$shrunk" 2>&1)
                    [[ -f $shrunk ]] || shrunk="shrink failed: $(tail -1 <<<"$shrunk_out")"
                fi
            fi
            entry="{\"target\":$(json_str "$t"),\"input\":$(json_str "${c#"$ROOT"/}"),\"signature\":$(json_str "$key"),\"trace\":$(json_str "${trace#"$ROOT"/}"),\"shrunk\":$(json_str "${shrunk#"$ROOT"/}")}"
        else
            bt=$(RUST_BACKTRACE=1 "$BIN_DIR/$t" -runs=1 "$c" 2>&1)
            site=$(grep -aoE "panicked at [^:]+:[0-9]+:[0-9]+" <<<"$bt" | head -1)
            frames=$(grep -aE '^ +[0-9]+: ' <<<"$bt" | grep -aE 'kvsim' | grep -avE 'fuzzing::|rust_fuzzer|libfuzzer' | head -3 | sed -E 's/^ +[0-9]+: //' | paste -sd ';' -)
            [[ -z $site ]] && site=$(grep -aoE 'ERROR: [A-Za-z]+: [a-z-]+' <<<"$bt" | head -1)
            key="${site:-unknown} | ${frames:-no kvsim frame}"
            msg=$(grep -aA1 "panicked at" <<<"$bt" | sed -n 2p)
            entry="{\"target\":$(json_str "$t"),\"input\":$(json_str "${c#"$ROOT"/}"),\"signature\":$(json_str "$key"),\"message\":$(json_str "$msg")}"
        fi
        if [[ -z ${seen[$key]:-} ]]; then
            seen[$key]=$(basename "$c")
            DETAIL[$t]+="    - $key ($(basename "$c"))"$'\n'
        fi
        FAILURES_JSON+="${FAILURES_JSON:+,}$entry"
    done
    UNIQUE[$t]=${#seen[@]}
    unset seen
done

# The report.
TOTAL_CRASHES=0
TARGETS_JSON=""
TEXT="kvsim fuzz/overnight.sh: ${N} targets, ${SECONDS_TOTAL} s asked, ${JOBS} processes, from ${STARTED_AT} to ${ENDED_AT}"
((INTERRUPTED)) && TEXT+=" (interrupted)"
TEXT+=$'\n'
TEXT+=$(printf '%-12s %7s %14s %10s %8s %8s %17s %17s %7s %7s %9s\n' target procs executions exec/s cov ft "corpus start" "corpus before/after" crashes unique "peak RSS")
TEXT+=$'\n'
for t in "${T[@]}"; do
    line=$(last_stats "$RUN_DIR/$t.log")
    runs=$(sed -nE 's/^#([0-9]+):.*/\1/p' <<<"$line")
    cov=$(field "$line" cov)
    ft=$(field "$line" ft)
    secs=$(sed -nE 's/.* time: ([0-9]+)s.*/\1/p' <<<"$line")
    runs=${runs:-0} cov=${cov:-0} ft=${ft:-0} secs=${secs:-0}
    eps=$(awk -v r="$runs" -v s="$secs" 'BEGIN { printf "%.1f", (s > 0 ? r / s : 0) }')
    peak_mb=$(awk -v k="${PEAK_KB[$t]}" 'BEGIN { printf "%.1f", k / 1024 }')
    TOTAL_CRASHES=$((TOTAL_CRASHES + CRASHES[$t]))
    TARGETS_JSON+="${TARGETS_JSON:+,}{\"name\":$(json_str "$t"),\"processes\":${WORKERS[$t]},\"seconds\":$secs,\"executions\":$runs,\"executions_per_s\":$eps,\"coverage\":$cov,\"features\":$ft,"
    TARGETS_JSON+="\"corpus_start\":{\"files\":${START_FILES[$t]},\"bytes\":${START_BYTES[$t]}},\"corpus_before_minimization\":{\"files\":${BEFORE_FILES[$t]},\"bytes\":${BEFORE_BYTES[$t]}},"
    TARGETS_JSON+="\"corpus_after_minimization\":{\"files\":${AFTER_FILES[$t]},\"bytes\":${AFTER_BYTES[$t]}},\"minimization\":$(json_str "${MERGE_NOTE[$t]}"),"
    TARGETS_JSON+="\"crashes\":${CRASHES[$t]},\"distinct_crashes\":${UNIQUE[$t]},\"ooms\":${OOMS[$t]},\"timeouts\":${TIMEOUTS[$t]},\"slow_units\":${SLOW[$t]},\"peak_rss_mb\":$peak_mb,\"last_status\":$(json_str "$line")}"
    TEXT+=$(printf '%-12s %7s %14s %10s %8s %8s %17s %17s %7s %7s %7s MB\n' "$t" "${WORKERS[$t]}" "$runs" "$eps" "$cov" "$ft" \
        "${START_FILES[$t]}" "${BEFORE_FILES[$t]}/${AFTER_FILES[$t]}" "${CRASHES[$t]}" "${UNIQUE[$t]}" "$peak_mb")
    TEXT+=$'\n'
    [[ -n ${DETAIL[$t]} ]] && TEXT+="${DETAIL[$t]}"
done
TEXT+="crashes: ${TOTAL_CRASHES}"
((TOTAL_CRASHES > 0)) && TEXT+=" (sim_trace crashes as traces in target/kvsim-failures/; a fixed crash's input goes into fuzz/seeds/TARGET/, replayed by cargo test)"
TEXT+=$'\n'

{
    printf '{"tool":"fuzz/overnight.sh","started":%s,"ended":%s,"seconds_asked":%s,"jobs":%s,"rss_limit_mb":%s,"timeout_s":%s,' \
        "$(json_str "$STARTED_AT")" "$(json_str "$ENDED_AT")" "$SECONDS_TOTAL" "$JOBS" "$RSS_LIMIT_MB" "$TIMEOUT_S"
    printf '"interrupted":%s,"machine":{"cores":%s,"cargo_fuzz":%s},"crashes":%s,"targets":[%s],"failures":[%s]}\n' \
        "$( ((INTERRUPTED)) && echo true || echo false)" "$(nproc)" "$(json_str "$(cargo fuzz --version 2>/dev/null)")" \
        "$TOTAL_CRASHES" "$TARGETS_JSON" "$FAILURES_JSON"
} >"$REPORT_DIR/report.json.tmp" && mv "$REPORT_DIR/report.json.tmp" "$REPORT_DIR/report.json"
printf '%s' "$TEXT" >"$REPORT_DIR/report.txt"
printf '%s' "$TEXT"
echo "overnight: report in $REPORT_DIR/report.json and $REPORT_DIR/report.txt"
((TOTAL_CRASHES == 0)) || exit 1
