//! The chunked attention cache ([`ChunkedKvCache`], storage kind `kv-chunked:<chunk_size>`): a linear plain cache
//! whose front is trimmed to at most `chunk_size` live positions when the model asks for it.
//!
//! The rule follows mlx-lm 0.32.2's `ChunkedKVCache` (`mlx_lm/models/cache.py`), which llama4
//! (`mlx_lm/models/llama4.py`, `LlamaModel.__call__`) trims with `maybe_trim_front()` before every forward:
//! - writes append, exactly as a linear cache's (`update_and_fetch`: no trim on write, so between trims the cache may
//!   hold more than `chunk_size` positions);
//! - [`ChunkedKvCache::maybe_trim_front`]: when the live positions `offset - start_position` exceed `chunk_size`, the
//!   oldest `valid - chunk_size` are dropped and `start_position` advances by as many; `offset` never moves;
//! - reads see the live columns `[start_position, offset)` in position order (a linear cache whose `len` is below its
//!   `offset`): a window read is causal by position, a decode read sees every live column.
//!
//! Not here: llama4's chunk *mask* (queries see only keys of their own `attention_chunk_size` block). It is the
//! model's (`create_chunked_attention_mask` lives in `llama4.py`, not in the cache), and kvsim's reads have no chunk
//! geometry; a caller that needs it builds that mask itself. What is guaranteed is the cache's own contract: after
//! any sequence of appends and front trims, the live columns, their bytes and `offset` / `start_position` equal
//! mlx-lm's (`tests/it/persist.rs` continues an mlx-lm file both ways).

use mlx_rs::ops::indexing::TryIndexOp;

use super::error::invalid;
use super::kind::{StorageKind, CHUNKED_PREFIX};
use super::ring::SerialCache;
use super::util::dim;
use super::{KvSpec, Result, Storage};

/// A linear plain cache with mlx-lm's chunk rule (see the module docs).
#[derive(Debug, Clone)]
pub struct ChunkedKvCache {
    cache: SerialCache,
    chunk_size: usize,
}

impl ChunkedKvCache {
    /// An empty cache (`chunk_size >= 1`).
    pub fn new(spec: KvSpec, chunk_size: usize) -> Result<Self> {
        Self::from_cache(SerialCache::new(spec, None)?, chunk_size)
    }

    /// A chunked cache over a linear plain cache (its `offset - len` is the start position). A window, affine storage
    /// or `chunk_size = 0` is [`super::CacheError::InvalidState`].
    pub fn from_cache(cache: SerialCache, chunk_size: usize) -> Result<Self> {
        if chunk_size == 0 {
            return Err(invalid("chunk_size 0"));
        }
        if cache.max_size().is_some() || cache.storage() != Storage::Plain {
            return Err(invalid(format!("a chunked cache wraps a linear plain cache, not {}", cache.storage_kind())));
        }
        Ok(ChunkedKvCache { cache, chunk_size })
    }

    /// The chunk size.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// The first live position (mlx-lm's `start_position`): `offset - len`.
    pub fn start_position(&self) -> usize {
        let s = self.cache.state();
        s.offset - s.len
    }

    /// Positions ever written.
    pub fn offset(&self) -> usize {
        self.cache.offset()
    }

    /// The linear cache that holds the live columns (reads and writes go through it).
    pub fn cache(&self) -> &SerialCache {
        &self.cache
    }

    /// The linear cache, mutably: decode, window and append behave as a linear cache's.
    pub fn cache_mut(&mut self) -> &mut SerialCache {
        &mut self.cache
    }

    /// `kv-chunked:<chunk_size>` (R-C-1).
    pub fn storage_kind(&self) -> StorageKind {
        StorageKind::new(format!("{CHUNKED_PREFIX}{}", self.chunk_size))
    }

    /// mlx-lm's `maybe_trim_front`: drop the oldest positions beyond `chunk_size`; returns how many were dropped.
    /// The kept columns are copied as they are (bytes unchanged), `offset` is kept.
    pub fn maybe_trim_front(&mut self) -> Result<usize> {
        let s = self.cache.state().clone();
        if s.len <= self.chunk_size {
            return Ok(0);
        }
        let trim = s.len - self.chunk_size;
        let (k, v) = self.cache.temporal_view()?;
        let (a, b) = (dim(trim)?, dim(s.len)?);
        let k = k.try_index((.., .., a..b, ..))?;
        let v = v.try_index((.., .., a..b, ..))?;
        let cache = SerialCache::from_temporal(self.cache.spec(), None, &k, &v, s.offset)?;
        self.cache = cache;
        Ok(trim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::ArrayBytes;
    use crate::{KvDtype, Masks};

    fn kv(n: usize, seed: f32) -> mlx_rs::Array {
        let v: Vec<f32> = (0..2 * n * 4).map(|i| seed + i as f32).collect();
        mlx_rs::Array::from_slice(&v, &[1, 2, n as i32, 4])
    }

    #[test]
    fn trim_front_keeps_the_newest_chunk_and_the_offset() {
        let _g = crate::testutil::testlock::shared();
        let spec = KvSpec { heads_kv: 2, head_dim: 4, dtype: KvDtype::F32 };
        let mut c = ChunkedKvCache::new(spec, 4).unwrap();
        assert_eq!(c.maybe_trim_front().unwrap(), 0);
        c.cache_mut().append(&kv(6, 0.0), &kv(6, 100.0)).unwrap();
        assert_eq!((c.offset(), c.start_position()), (6, 0));
        assert_eq!(c.maybe_trim_front().unwrap(), 2);
        assert_eq!((c.offset(), c.start_position(), c.cache().state().len), (6, 2, 4));
        let (k, _) = c.cache().temporal_view().unwrap();
        let want = kv(6, 0.0).try_index((.., .., 2..6, ..)).unwrap();
        assert_eq!(ArrayBytes::of(&k).unwrap(), ArrayBytes::of(&want).unwrap());
        // A decode then reads the four live columns plus the new one; the next trim drops one.
        let q = mlx_rs::Array::from_slice(&[0.5f32; 8], &[1, 2, 1, 4]);
        c.cache_mut().decode(&kv(1, 7.0), &kv(1, 8.0), &q, 0.5, &Masks::new()).unwrap();
        assert_eq!(c.maybe_trim_front().unwrap(), 1);
        assert_eq!((c.offset(), c.start_position()), (7, 3));
        assert_eq!(c.storage_kind().0, "kv-chunked:4");
        assert!(ChunkedKvCache::new(spec, 0).is_err());
        assert!(ChunkedKvCache::from_cache(SerialCache::new(spec, Some(4)).unwrap(), 4).is_err());
    }
}
