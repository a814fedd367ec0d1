//! The mutation catalog: fault hooks in the production caches, compiled only with the cargo feature `faults`.
//!
//! Each [`Mutant`] is one deliberate bug, planted at exactly one place of production code (named in its docs), and
//! inert unless it is [`arm`]ed. The harness (the `kvsim-harness` crate, the only one that turns the feature on)
//! arms one mutant at a time and proves that its checks catch it. Without the feature this module does not exist
//! and every hook site is the constant `false` of the crate's `fault!` macro: a build with default features
//! contains no fault hook and no way to arm one.
//!
//! The armed mutant is per thread: arming one affects the caches the calling thread drives, and nothing that runs
//! beside it (parallel tests, or simulations on other threads).

/// One planted bug. See each variant for the single place it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Mutant {
    /// `temporal_view` (serial and per row) takes the *head* of the temporal order instead of the tail
    /// (optiq's `_read_cache_temporal` bug, R-ROT-4). Hook: `ring::temporal_view_columns`.
    TemporalHead,
    /// A batched decode read attends with no mask even when rows' `len` differ, so shorter rows see stale or zero
    /// columns (R-C-2). Hook: `RowBatch::decode` read.
    MaskIgnoresPadding,
    /// `merge` records each row's `len` as `min(offset, widest row)` instead of its slice length, so padding
    /// columns become live (R-BROT-4). Hook: `RowBatch::merge`.
    MergeSlicesByOffset,
    /// `RowBatch::storage_kind` reports the serial kind without the row-batch marker, so `join` routes the batch
    /// as one serial row and drops the others (R-BROT-10). Hook: `RowBatch::storage_kind`.
    MissingKindOverride,
    /// `trim(n, bypass = true)` returns `Ok(0)` and does nothing once `offset >= W` (R-C-5). Hook:
    /// `ring::plan_trim`.
    TrimNoopAfterWrap,
    /// `extract` de-rolls the bytes but keeps the row's old write head `idx` instead of `len` (R-BROT-5). Hook:
    /// `RowBatch::extract`.
    PhaseKeptAfterExtract,
    /// `rope_offsets` returns a handle aliasing the batch's live offsets, which later writes update in place (bug
    /// catalog #3, R-BROT-3). Hook: `RowBatch::rope_offsets`.
    OffsetAliasing,
    /// Window writes during a prepared (right-padded) prefill store the padded positions as if they were real.
    /// Hook: the real-count computation of `RowBatch`'s window write.
    PrefillPadStored,
    /// Window writes keep `min(len, W)` history columns instead of `W - 1` (R-ROT-3). Hook: `ring::window_keep`.
    ConcatKeepsWindow,
    /// A batched decode writes every row at one shared column (row 0's target), as mlx-lm's shared `_idx` does,
    /// instead of each row's own ring head (R-BROT-8). Hook: `RowBatch::decode` scatter.
    SharedWritePointer,
    /// The packed width of a quantized plane is computed as `D / (32 / bits)` (mlx-lm's `QuantizedKVCache`
    /// allocation), wrong for 3, 5 and 6 bits at `D = 128` (e.g. 21 words instead of 20). Hook:
    /// `quant::packed_width`.
    QuantPackedWidthDivides,
    /// A quantized batch's decode mask is built from the per-row array offset plus left padding instead of each
    /// row's buffered count `len_r` (mlx-vlm#1206). Hook: `RowBatch` decode read.
    QuantMaskFromArrayOffset,
    /// A one-row quantized batch's window read takes the plain single-request path over this block only: the
    /// quantized prompt context is lost (mlx-vlm#1310). Hook: `RowBatch::window` read.
    QuantSinglePlainPath,
    /// The quantized read does not give the `[B, 1, L, S]` mask the GQA `rep` axis, so it broadcasts from the right
    /// and its batch axis lands on the kv-head axis (mlx-lm#1322). Hook: `quant::quantized_attend`.
    QuantGqaMaskWrongAxis,
    /// `to_quantized` of a rotated ring converts the buffer in temporal order but keeps the ring phase (R-ROT-8).
    /// Hook: `SerialCache::to_quantized`, `RowBatch::to_quantized`.
    QuantConvertTemporalOrder,
    /// The codec registry drops `minimum_reusable_offset` when saving (the reuse floor is not persisted). Hook:
    /// `persist::codec::Registry::encode`.
    FloorNotPersisted,
    /// Loading drops a row batch's pending right padding (each row's `pending`), as mlx-lm 0.32.2's
    /// `load_prompt_cache` loses `_right_padding` / `_lengths` (mlx-lm 0.32.2 `cache.py`, `load_prompt_cache`): a batch saved mid-prefill comes
    /// back "finalized", so its padded positions are stored as real. Hook: `persist::codec::RowsCodec::decode`.
    MlxlmLoadDropsRightPadding,
    /// The `rotated` flag of a `BatchRotatingKVCache` is parsed with Python's truthiness from a string leaf
    /// (`bool("False")` is `True`: older mlx-lm files wrote it as a string), instead of refusing anything but a
    /// boolean. Hook: `persist::mlxlm` `boolean`.
    MlxlmRotatedFlagFromString,
    /// The serial codec saves the whole allocated buffer (`cap` columns) instead of the live columns `[0, len)`: for
    /// a linear cache, whose offset marks the end of its data, the spare capacity comes back as live positions (or
    /// the file is refused on load). Hook: `persist::codec::whole_buffer`.
    CodecSavesWholeBuffer,
    /// The recurrent mask of an `SsmCache` call ignores left padding (`pos < lengths` only), so a merged row's
    /// left padding is folded into its recurrent state (bug catalog #1). Hook: `SsmCache::call`.
    SsmMaskIgnoresLeftPadding,
    /// A rollback replays one position more than accepted (capped at the window). Hook:
    /// `SsmCache::spec_round_rollback_rows`.
    SsmReplayOneMore,
    /// A rollback replays one position fewer than accepted. Hook: `SsmCache::spec_round_rollback_rows`.
    SsmReplayOneFewer,
    /// With prepared padding, the new conv tail is the last `K-1` rows of the padded window, not each row's real
    /// end. Hook: `forward`'s tail index in `ssm.rs`.
    SsmConvTailAtPaddedEnd,
    /// A padded (prepared) call advances each row's history by the window width and finalize does not roll it
    /// back to the real count (mlx-lm#1821's class). Hook: `SsmCache::call` offsets.
    SsmFinalizeKeepsPaddedHistory,
    /// `filter` on an empty batch with pending left padding shifts the padding off as if columns had been
    /// dropped (mlx-lm#1736's class). Hook: `SsmCache::filter`.
    SsmFilterShiftsEmptyPadding,
    /// A per-row rollback restores each row from its neighbour's pre-round snapshot (row `b` gets row `(b + 1) mod
    /// B`'s states): a state handed to the wrong request. Hook: `SsmCache::spec_round_rollback_rows`.
    SsmRollbackNeighbourSnapshot,
    /// A batched decode read of rows of equal `len` attends the key/value columns in reverse physical order. The
    /// attention is mathematically the same (every column is visible, K and V are permuted alike); only the
    /// summation order changes, so only a rounding-level difference reveals it: the byte comparison of decode
    /// outputs with the solo twin (`decode_vs_solo`), never the f64 model's ULP bound. Hook: `RowBatch::decode`
    /// read.
    DecodeKeyOrder,
    /// A batched decode read scales the scores by the next representable f32 above `scale` (one ULP of the scale):
    /// a rounding-level difference only the byte comparison with the solo twin sees. Hook: `RowBatch::decode` read.
    DecodeScaleUlp,
    /// `adopt` / `adopt_planes` drop each row's ring phase (`idx` set to `len`): a rotated row's next decode
    /// overwrites the wrong column. Hook: `RowBatch::adopt_planes`. Reached only by generated adopts.
    AdoptDropsPhase,
    /// `filter` validates as it goes: on a missing or repeated row id it has already kept the rows listed before
    /// it, and returns the typed error with the batch changed. Hook: `RowBatch::filter`. Reached only by generated
    /// ill-formed row ids.
    FilterPartialOnError,
    /// A prepared length of 0 is read as "no limit": the row stores every position of the next chunks (padding
    /// included) instead of none. Hook: `RowBatch` window write. Reached only by generated prepares with a length
    /// of 0.
    PendingZeroTakesAll,
    /// `row_decode_phase` answers from the row's raw state, before the oversize drop and the head rotation a decode
    /// would first do (R-ROT-5). Hook: `RowBatch::row_decode_phase`. Reached only by generated decode-phase probes
    ///.
    RowPhaseIgnoresOversize,
    /// The decode step's oversize drop keeps the batch buffer's old width (and no decode step cuts it to the rows'
    /// capacity bound): a ring that joined with a 128-position prompt at `W = 70` keeps 128 columns per row for the
    /// batch's whole life, while its rows hold 70 (reads unchanged; memory held past the documented bound,
    /// `RowBatch`'s "Capacity"). Hook: `RowBatch::prepare_decode_step` (the drop's gather).
    BatchRingKeepsOversize,
    /// The encoder read masks with the cache's own window (`max_size`: `None` for a linear cache) instead of the
    /// encoder's: a query sees what the cache's window would let it see, not what the encoder's lets it see.
    /// Hook: `SerialCache::encoder_read`, `RowBatch::encoder_read`.
    EncoderWindowFromCache,
    /// `to_quantized` of a cache that holds no buffer yet (a request with no positions) takes the target
    /// parameters whatever its storage is: beside a batch already quantized at other parameters, the empty
    /// request converts where every other cache refuses (`StorageMismatch`), and its first write lands in other
    /// planes than its batch's. Hook: `SerialCache::to_quantized`.
    QuantConvertEmptyIgnoresStorage,
    /// Transitioning rows settle (convert if due) after every append even inside an armed speculative round, so a
    /// conversion looks at an uncommitted suffix. Hook: `TransitioningKvRows::settle_all`.
    TkvConvertUncommitted,
    /// Transitioning rows settle after every append of a prefill cohort, so a sibling's split forward moves a
    /// row's boundary to the split (R-C-7). Hook: `TransitioningKvRows::settle_all`.
    TkvSplitMovesBoundary,
    /// Prefix reuse (`take`) skips the floor check and trims below `minimum_reusable_offset`. Hook:
    /// `Bf16FirstCache::take`.
    TkvReuseBelowFloor,
    /// Rows pack as soon as one row has converted, not once every row has. Hook: `TransitioningKvRows::maybe_pack`.
    TkvPackBeforeAllConverted,
    /// A rollback of unpacked rows drops one kept position of every row that rejected some (the kept bytes are not
    /// all kept). Hook: `TransitioningKvRows::round_rollback`.
    TkvRollbackDropsKept,
    /// A row handed back to serial use loses its floor (`extract` composes the lego with floor 0). Hook:
    /// `TransitioningKvRows::extract`.
    TkvFloorLostByExtract,
    /// `end_prefill` ends a chunked prefill cohort without committing the requests that did not commit their
    /// chunks: a row past its transition stays bf16 (the upstream engine's "prefill defers conversion" vector, which
    /// kvsim's rows failed before they committed at the end). Hook: `TransitioningKvRows::end_prefill`.
    TkvEndPrefillLeavesDue,
    /// kvsim's file reader skips the per-tensor sha256: a file whose tensor bytes were damaged loads as other values.
    /// Hook: `kvsim_persist::kvsim::decode_entries`.
    KvsimSkipsTensorChecksum,
    /// kvsim's file writer stores every layer's bookkeeping (offset, ring phase, trim record) from the first layer
    /// of the same storage kind: a set whose layers are alike still loads, one whose layers differ comes back wrong
    /// or is refused (the class of mlx-lm#1494 / #1502, whose `trim_prompt_cache` reports layer 0's count for
    /// every layer). Hook: `kvsim_persist::kvsim::encode`.
    FirstLayerBookkeeping,
    /// An append into a partly filled block that another holder shares writes into it in place instead of copying it
    /// first: the other holder (a fork, the prefix index) sees positions it never wrote. Hook: `PagedStore`'s write
    /// plan.
    PagedCowSkipped,
    /// Releasing a sequence (finish, release, the rows a filter hands back) leaves its blocks' reference counts as
    /// they were: the blocks never return to the pool (a leak). Hook: `PagedStore::release`.
    PagedRefLeak,
    /// Releasing a sequence takes two references from every block it shares with another holder: a block still in
    /// someone's table reaches the free list and is handed out again while it is read (use after free). Hook:
    /// `PagedStore::release`.
    PagedDoubleFree,
    /// A prefix lookup accepts a cached block that agrees with the prompt's next tokens on a part of itself only (a
    /// partial last block, or a block the prompt leaves midway) as if the whole block matched: the request holds
    /// positions of another prompt (the radix-boundary corruption of SGLang#22819's class). Hook: the prefix
    /// index's match.
    PagedPartialMatch,
    /// Eviction takes the least recently used leaf even when a sequence still references its block, and returns the
    /// block to the pool: the sequence reads a block that is handed out again. Hook: `PagedStore::evict`.
    PagedEvictReferenced,
    /// A rollback (`trim` with `bypass`) lowers the offset but keeps the tail blocks in the block table: their
    /// blocks stay held (phantom positions the pool counts as used). Hook: `PagedStore::trim`.
    PagedRollbackKeepsTable,
    /// The prefix lookup matches a block by its own tokens wherever it sits in the index when its parent has no
    /// such child (a block hash that leaves out the hash of the blocks before it): a prompt whose next block repeats
    /// one cached under another prefix takes that block's K/V, computed after other tokens. Hook: the prefix
    /// index's match (`PrefixIndex::matching`).
    PagedMatchIgnoresParent,
    /// Copy-on-write of a shared, partly filled block of an affine pool copies the packed words but not the scales
    /// and biases: the writer's copy dequantizes its shared positions with whatever the new block held. Hook:
    /// `PagedStore`'s write (the copy-on-write copy).
    PagedAffineCowPackedOnly,
    /// A right-padded prefill chunk reads plain rows under `Causal` whenever every row holds the same number of
    /// positions, whether or not each took the whole chunk: a row that ends at the others' length with only part
    /// of the chunk has its queries aligned to the chunk's width, not to its real positions. Hook:
    /// `PagedStore::rows_window`.
    PagedPrefillCausalByLength,
    /// mlx-lm's file writer records the first recurrent layer's offsets (the `ArraysCache` offsets it carries in
    /// the user metadata, `kvsim_ssm_offsets`) for every recurrent layer of the file: a file whose recurrent layers
    /// all saw the same tokens still loads right, one whose recurrent layers hold different offsets (a layer set,
    /// a `CacheList` of them) comes back with every layer at the first one's offset. Hook:
    /// `kvsim_persist::mlxlm::file_from_kvsim`.
    MlxlmSsmOffsetsFromFirst,
    /// mlx-lm's file reader gives every empty attention layer (no array: mlx-lm writes only its class name) the
    /// spec of the file's first empty layer (`kvsim_empty_specs` by path): a file whose empty layers share one spec
    /// loads right, one whose empty layers differ in heads, head dim or dtype comes back with the first one's. Hook:
    /// `kvsim_persist::mlxlm::Hints::spec_at`.
    MlxlmEmptySpecFromFirst,
    /// `TransitioningKvRows::adopt` records every converted row's conversion at its current offset (the boundary
    /// where the row came due and converted is dropped; storage, floor and padding kept): the adopted rows' lifecycle
    /// is not the one their parts carried. Hook: `TransitioningKvRows::adopt`. Reached only by generated adopts of
    /// bf16-first rows.
    TkvAdoptDropsBoundary,
    /// The rows' softcapped fetch converts only the first row whose transition came due in the call, when several
    /// come due together: the others stay bf16 past their boundary (and convert at a later append, at the wrong
    /// offset). Hook: `TransitioningKvRows::fetch`.
    TkvFetchConvertsFirstDue,
}

impl Mutant {
    /// Every mutant, in catalog order.
    pub const ALL: &'static [Mutant] = &[
        Mutant::TemporalHead,
        Mutant::MaskIgnoresPadding,
        Mutant::MergeSlicesByOffset,
        Mutant::MissingKindOverride,
        Mutant::TrimNoopAfterWrap,
        Mutant::PhaseKeptAfterExtract,
        Mutant::OffsetAliasing,
        Mutant::PrefillPadStored,
        Mutant::ConcatKeepsWindow,
        Mutant::SharedWritePointer,
        Mutant::QuantPackedWidthDivides,
        Mutant::QuantMaskFromArrayOffset,
        Mutant::QuantSinglePlainPath,
        Mutant::QuantGqaMaskWrongAxis,
        Mutant::QuantConvertTemporalOrder,
        Mutant::FloorNotPersisted,
        Mutant::MlxlmLoadDropsRightPadding,
        Mutant::MlxlmRotatedFlagFromString,
        Mutant::CodecSavesWholeBuffer,
        Mutant::SsmMaskIgnoresLeftPadding,
        Mutant::SsmReplayOneMore,
        Mutant::SsmReplayOneFewer,
        Mutant::SsmConvTailAtPaddedEnd,
        Mutant::SsmFinalizeKeepsPaddedHistory,
        Mutant::SsmFilterShiftsEmptyPadding,
        Mutant::SsmRollbackNeighbourSnapshot,
        Mutant::DecodeKeyOrder,
        Mutant::DecodeScaleUlp,
        Mutant::AdoptDropsPhase,
        Mutant::FilterPartialOnError,
        Mutant::PendingZeroTakesAll,
        Mutant::RowPhaseIgnoresOversize,
        Mutant::BatchRingKeepsOversize,
        Mutant::EncoderWindowFromCache,
        Mutant::QuantConvertEmptyIgnoresStorage,
        Mutant::TkvConvertUncommitted,
        Mutant::TkvSplitMovesBoundary,
        Mutant::TkvReuseBelowFloor,
        Mutant::TkvPackBeforeAllConverted,
        Mutant::TkvRollbackDropsKept,
        Mutant::TkvFloorLostByExtract,
        Mutant::TkvEndPrefillLeavesDue,
        Mutant::KvsimSkipsTensorChecksum,
        Mutant::FirstLayerBookkeeping,
        Mutant::PagedCowSkipped,
        Mutant::PagedRefLeak,
        Mutant::PagedDoubleFree,
        Mutant::PagedPartialMatch,
        Mutant::PagedEvictReferenced,
        Mutant::PagedRollbackKeepsTable,
        Mutant::PagedMatchIgnoresParent,
        Mutant::PagedAffineCowPackedOnly,
        Mutant::PagedPrefillCausalByLength,
        Mutant::MlxlmSsmOffsetsFromFirst,
        Mutant::MlxlmEmptySpecFromFirst,
        Mutant::TkvAdoptDropsBoundary,
        Mutant::TkvFetchConvertsFirstDue,
    ];

    /// A stable kebab-case name (CLI, traces).
    pub fn name(&self) -> &'static str {
        match self {
            Mutant::TemporalHead => "temporal-head",
            Mutant::MaskIgnoresPadding => "mask-ignores-padding",
            Mutant::MergeSlicesByOffset => "merge-slices-by-offset",
            Mutant::MissingKindOverride => "missing-kind-override",
            Mutant::TrimNoopAfterWrap => "trim-noop-after-wrap",
            Mutant::PhaseKeptAfterExtract => "phase-kept-after-extract",
            Mutant::OffsetAliasing => "offset-aliasing",
            Mutant::PrefillPadStored => "prefill-pad-stored",
            Mutant::ConcatKeepsWindow => "concat-keeps-window",
            Mutant::SharedWritePointer => "shared-write-pointer",
            Mutant::QuantPackedWidthDivides => "quant-packed-width-divides",
            Mutant::QuantMaskFromArrayOffset => "quant-mask-from-array-offset",
            Mutant::QuantSinglePlainPath => "quant-single-plain-path",
            Mutant::QuantGqaMaskWrongAxis => "quant-gqa-mask-wrong-axis",
            Mutant::QuantConvertTemporalOrder => "quant-convert-temporal-order",
            Mutant::FloorNotPersisted => "floor-not-persisted",
            Mutant::MlxlmLoadDropsRightPadding => "mlxlm-load-drops-right-padding",
            Mutant::MlxlmRotatedFlagFromString => "mlxlm-rotated-flag-from-string",
            Mutant::CodecSavesWholeBuffer => "codec-saves-whole-buffer",
            Mutant::SsmMaskIgnoresLeftPadding => "ssm-mask-ignores-left-padding",
            Mutant::SsmReplayOneMore => "ssm-replay-one-more",
            Mutant::SsmReplayOneFewer => "ssm-replay-one-fewer",
            Mutant::SsmConvTailAtPaddedEnd => "ssm-conv-tail-at-padded-end",
            Mutant::SsmFinalizeKeepsPaddedHistory => "ssm-finalize-keeps-padded-history",
            Mutant::SsmFilterShiftsEmptyPadding => "ssm-filter-shifts-empty-padding",
            Mutant::SsmRollbackNeighbourSnapshot => "ssm-rollback-neighbour-snapshot",
            Mutant::DecodeKeyOrder => "decode-key-order",
            Mutant::DecodeScaleUlp => "decode-scale-ulp",
            Mutant::AdoptDropsPhase => "adopt-drops-phase",
            Mutant::FilterPartialOnError => "filter-partial-on-error",
            Mutant::PendingZeroTakesAll => "pending-zero-takes-all",
            Mutant::RowPhaseIgnoresOversize => "row-phase-ignores-oversize",
            Mutant::BatchRingKeepsOversize => "batch-ring-keeps-oversize",
            Mutant::EncoderWindowFromCache => "encoder-window-from-cache",
            Mutant::QuantConvertEmptyIgnoresStorage => "quant-convert-empty-ignores-storage",
            Mutant::TkvConvertUncommitted => "tkv-convert-uncommitted",
            Mutant::TkvSplitMovesBoundary => "tkv-split-moves-boundary",
            Mutant::TkvReuseBelowFloor => "tkv-reuse-below-floor",
            Mutant::TkvPackBeforeAllConverted => "tkv-pack-before-all-converted",
            Mutant::TkvRollbackDropsKept => "tkv-rollback-drops-kept",
            Mutant::TkvFloorLostByExtract => "tkv-floor-lost-by-extract",
            Mutant::TkvEndPrefillLeavesDue => "tkv-end-prefill-leaves-due",
            Mutant::KvsimSkipsTensorChecksum => "kvsim-skips-tensor-checksum",
            Mutant::FirstLayerBookkeeping => "first-layer-bookkeeping",
            Mutant::PagedCowSkipped => "paged-cow-skipped",
            Mutant::PagedRefLeak => "paged-ref-leak",
            Mutant::PagedDoubleFree => "paged-double-free",
            Mutant::PagedPartialMatch => "paged-partial-match",
            Mutant::PagedEvictReferenced => "paged-evict-referenced",
            Mutant::PagedRollbackKeepsTable => "paged-rollback-keeps-table",
            Mutant::PagedMatchIgnoresParent => "paged-match-ignores-parent",
            Mutant::PagedAffineCowPackedOnly => "paged-affine-cow-packed-only",
            Mutant::PagedPrefillCausalByLength => "paged-prefill-causal-by-length",
            Mutant::MlxlmSsmOffsetsFromFirst => "mlxlm-ssm-offsets-from-first",
            Mutant::MlxlmEmptySpecFromFirst => "mlxlm-empty-spec-from-first",
            Mutant::TkvAdoptDropsBoundary => "tkv-adopt-drops-boundary",
            Mutant::TkvFetchConvertsFirstDue => "tkv-fetch-converts-first-due",
        }
    }

    /// The mutant whose `Mutant::name` is `s`.
    pub fn from_name(s: &str) -> Option<Mutant> {
        Self::ALL.iter().copied().find(|m| m.name() == s)
    }

    /// The layout family the mutant lives in: `"ssm"` for the recurrent cache's, `"persist"` for the persistence
    /// codecs' (`src/persist`), `"paged"` for the paged store's, `"kv"` for the other attention layouts'.
    pub fn layout(&self) -> &'static str {
        match self {
            Mutant::FloorNotPersisted
            | Mutant::MlxlmLoadDropsRightPadding
            | Mutant::MlxlmRotatedFlagFromString
            | Mutant::CodecSavesWholeBuffer
            | Mutant::KvsimSkipsTensorChecksum
            | Mutant::FirstLayerBookkeeping
            | Mutant::MlxlmSsmOffsetsFromFirst
            | Mutant::MlxlmEmptySpecFromFirst => "persist",
            _ if self.name().starts_with("ssm-") => "ssm",
            _ if self.name().starts_with("paged-") => "paged",
            _ => "kv",
        }
    }

    /// One sentence: what the planted bug does.
    pub fn describe(&self) -> &'static str {
        match self {
            Mutant::TemporalHead => "temporal_view takes the head of the temporal order instead of the tail",
            Mutant::MaskIgnoresPadding => "batched decode reads use no mask even when rows' lengths differ",
            Mutant::MergeSlicesByOffset => {
                "merge records each row's len as min(offset, widest row), not its slice length"
            }
            Mutant::MissingKindOverride => {
                "a row batch reports the serial kind without the row-batch marker, so join drops rows"
            }
            Mutant::TrimNoopAfterWrap => "trim with bypass returns 0 and does nothing once offset >= W",
            Mutant::PhaseKeptAfterExtract => "extract de-rolls the bytes but keeps the row's old write head",
            Mutant::OffsetAliasing => "rope_offsets aliases internal state that later writes update in place",
            Mutant::PrefillPadStored => "window writes of a prepared prefill store padded positions as real",
            Mutant::ConcatKeepsWindow => "window writes keep min(len, W) history columns instead of W - 1",
            Mutant::SharedWritePointer => "batched decode writes every row at one shared column, as mlx-lm does",
            Mutant::QuantPackedWidthDivides => {
                "quantized packed width computed as D / (32 / bits), wrong for 3/5/6 bits"
            }
            Mutant::QuantMaskFromArrayOffset => {
                "quantized batched decode mask built from the array offset plus left padding, not len"
            }
            Mutant::QuantSinglePlainPath => {
                "a one-row quantized batch reads through the plain path over its block only (context lost)"
            }
            Mutant::QuantGqaMaskWrongAxis => {
                "quantized GQA read broadcasts the batched mask without the rep axis (batch lands on kv heads)"
            }
            Mutant::QuantConvertTemporalOrder => {
                "to_quantized converts a wrapped ring in temporal, not physical, order"
            }
            Mutant::FloorNotPersisted => "saving drops the minimum reusable offset (the reuse floor)",
            Mutant::MlxlmLoadDropsRightPadding => "loading a batch drops its pending right padding (mlx-lm's load bug)",
            Mutant::MlxlmRotatedFlagFromString => "the rotated flag is read from a string with Python's truthiness",
            Mutant::CodecSavesWholeBuffer => "the serial codec saves the whole buffer, spare capacity included",
            Mutant::SsmMaskIgnoresLeftPadding => "the recurrent mask ignores left padding, folding it into the state",
            Mutant::SsmReplayOneMore => "a speculative rollback replays one position more than accepted",
            Mutant::SsmReplayOneFewer => "a speculative rollback replays one position fewer than accepted",
            Mutant::SsmConvTailAtPaddedEnd => "the conv tail is taken at the padded end of a prepared window",
            Mutant::SsmFinalizeKeepsPaddedHistory => {
                "a padded call advances rows by the window width and finalize does not roll it back"
            }
            Mutant::SsmFilterShiftsEmptyPadding => "filter on an empty batch shifts its pending left padding off",
            Mutant::SsmRollbackNeighbourSnapshot => "a rollback restores each row from its neighbour's snapshot",
            Mutant::DecodeKeyOrder => "batched decode reads attend the key columns in reverse order (rounding only)",
            Mutant::DecodeScaleUlp => "batched decode reads scale scores by one f32 ULP more (rounding only)",
            Mutant::AdoptDropsPhase => "adopt drops each row's ring phase (idx = len)",
            Mutant::FilterPartialOnError => "a refused filter keeps the rows it validated before the bad id",
            Mutant::PendingZeroTakesAll => "a prepared length of 0 stores every position of the next chunks",
            Mutant::RowPhaseIgnoresOversize => "row_decode_phase answers before the oversize drop and rotation",
            Mutant::BatchRingKeepsOversize => {
                "a batch of rings keeps its buffer's old width through the oversize drop (past its capacity bound)"
            }
            Mutant::EncoderWindowFromCache => "the encoder read masks with the cache's window instead of the encoder's",
            Mutant::QuantConvertEmptyIgnoresStorage => {
                "to_quantized of an empty cache takes the target parameters whatever its storage"
            }
            Mutant::TkvConvertUncommitted => "transitioning rows convert inside an armed round (an uncommitted suffix)",
            Mutant::TkvSplitMovesBoundary => "transitioning rows convert at a sibling's split forward inside a prefill",
            Mutant::TkvReuseBelowFloor => "prefix reuse trims below minimum_reusable_offset",
            Mutant::TkvPackBeforeAllConverted => "transitioning rows pack once any row has converted",
            Mutant::TkvRollbackDropsKept => "a round's rollback drops one kept position of every rejecting row",
            Mutant::TkvFloorLostByExtract => "a row handed back to serial use loses its reuse floor",
            Mutant::TkvEndPrefillLeavesDue => "end_prefill leaves an uncommitted row past its transition unconverted",
            Mutant::KvsimSkipsTensorChecksum => "kvsim's file reader skips the per-tensor checksums",
            Mutant::FirstLayerBookkeeping => {
                "kvsim's file writer stores every layer's bookkeeping from the first of its kind"
            }
            Mutant::PagedCowSkipped => "an append into a shared partial block writes in place (no copy-on-write)",
            Mutant::PagedRefLeak => "releasing a paged sequence leaves its blocks' reference counts (a leak)",
            Mutant::PagedDoubleFree => "releasing a paged sequence takes two references from each shared block",
            Mutant::PagedPartialMatch => {
                "a prefix lookup accepts a block the prompt matches only in part as a whole one"
            }
            Mutant::PagedEvictReferenced => "eviction frees a cached block a sequence still references",
            Mutant::PagedRollbackKeepsTable => "a paged rollback keeps the tail blocks in the block table",
            Mutant::PagedMatchIgnoresParent => {
                "a prefix lookup matches a block by its own tokens under any parent (a block hash without its parent's)"
            }
            Mutant::PagedAffineCowPackedOnly => {
                "copy-on-write of an affine block copies the packed words but not the scales and biases"
            }
            Mutant::PagedPrefillCausalByLength => {
                "a prefill chunk reads rows of one length under Causal even when one took only part of the chunk"
            }
            Mutant::MlxlmSsmOffsetsFromFirst => {
                "mlx-lm's file writer records the first recurrent layer's offsets for every recurrent layer"
            }
            Mutant::MlxlmEmptySpecFromFirst => {
                "mlx-lm's file reader gives every empty attention layer the first empty layer's spec"
            }
            Mutant::TkvAdoptDropsBoundary => "adopted bf16-first rows record each conversion at the current offset",
            Mutant::TkvFetchConvertsFirstDue => "the rows' fetch converts only the first of several rows come due",
        }
    }

    /// Whether the simulator's layout families reach this mutant's hook, so that `kvsim mutants` and the catalog
    /// tests can hunt it. Every mutant of the catalog is: the quantized ones through the quantized family
    /// (`sim::family::quant`), whose state check compares every plane with the twin and the reference's triples.
    /// Except two persistence mutants, caught by `kvsim-persist`'s tests (`persistence_mutants_break_a_check`):
    /// `mlxlm-rotated-flag-from-string` (mlx-lm 0.32.2 and kvsim write the flag as a boolean, so only a file in the
    /// older string layout reaches it) and `mlxlm-load-drops-right-padding` (the simulator saves caches between ops,
    /// where no prefill is ever pending: `Prepare` and `BatchPrefill` finalize inside their op).
    pub fn in_simulator(self) -> bool {
        !matches!(self, Mutant::MlxlmRotatedFlagFromString | Mutant::MlxlmLoadDropsRightPadding)
    }

    fn code(self) -> u8 {
        Self::ALL.iter().position(|m| *m == self).map_or(0, |i| i as u8 + 1)
    }
}

impl std::fmt::Display for Mutant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

thread_local! {
    // Per thread: a mutant armed by one test (or one simulation) never leaks into another running beside it.
    // The caches' hooks run on the thread that calls the cache (MLX's worker threads never call back into them).
    static ARMED: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

thread_local! {
    // Under `OffsetAliasing` only: the per-row offsets of the row batch this thread changed last, which is what an
    // aliasing `rope_offsets` handle reads. The caches hold no shared state for it; their mutations publish here.
    static ALIASED_OFFSETS: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Hook of `Mutant::OffsetAliasing`: a row batch just changed; when the mutant is armed, its offsets become what
/// every aliasing handle of this thread reads. Does nothing (and computes nothing) otherwise.
pub(crate) fn publish_offsets(offsets: impl FnOnce() -> Vec<i32>) {
    if is(Mutant::OffsetAliasing) {
        let v = offsets();
        ALIASED_OFFSETS.with(|a| *a.borrow_mut() = v);
    }
}

/// What an aliasing `rope_offsets` handle reads now (see [`publish_offsets`]).
pub(crate) fn aliased_offsets() -> Vec<i32> {
    ALIASED_OFFSETS.with(|a| a.borrow().clone())
}

/// Arm one mutant for the calling thread (`None` disarms).
pub fn arm(m: Option<Mutant>) {
    ARMED.with(|a| a.set(m.map_or(0, Mutant::code)));
}

/// The armed mutant, if any.
pub fn armed() -> Option<Mutant> {
    match ARMED.with(|a| a.get()) {
        0 => None,
        c => Mutant::ALL.get(c as usize - 1).copied(),
    }
}

/// Whether the hook of `m` fires here: `m` is armed on the calling thread. Hooks call it through the crate's
/// `fault!` macro, which is the constant `false` when this module is not compiled.
#[doc(hidden)]
#[inline]
pub fn is(m: Mutant) -> bool {
    ARMED.with(|a| a.get()) == m.code()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_arming_is_per_thread() {
        let _g = crate::testutil::testlock::arm(Mutant::TemporalHead);
        assert_eq!(armed(), Some(Mutant::TemporalHead));
        assert!(is(Mutant::TemporalHead));
        assert!(!is(Mutant::ConcatKeepsWindow));
        assert_eq!(std::thread::spawn(armed).join().unwrap(), None, "another thread sees no mutant");
        for m in Mutant::ALL {
            assert_eq!(Mutant::from_name(m.name()), Some(*m));
            assert!(!m.describe().is_empty());
        }
        let mut names: Vec<_> = Mutant::ALL.iter().map(|m| m.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Mutant::ALL.len());
    }
}
