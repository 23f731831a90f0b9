// The batch addressing every batched kernel shares (model/kernels/batch.py is its host twin).
//
// A launch covers `m` entries. Entry e is four u32 words: the sequence slot it belongs to, its
// drafter row (a kernel adds its immediate `row_add`, the draft index), the token it embeds, and
// one reserved word. An entry whose slot is BATCH_PAD is padding of a bucket graph: a kernel reads
// and writes nothing of any sequence for it (projections may still compute its scratch row).
//
// Per-sequence state lives in pools indexed by slot, every slot sized for `slot_rows` rows:
// indexer keys / gates [slots][slot_rows][idim], pool keys [slots][pools_per_slot][idim] (FP8),
// pool scales [slots][pools_per_slot], block tables [slots][blocks_per_slot] (u32 block ids of the
// paged latent cache).
#pragma once
#include <stdint.h>

#define BATCH_PAD 0xFFFFFFFFu
#define ENTRY_WORDS 4

struct BatchEntry {
    uint32_t slot;
    uint32_t row;
    uint32_t token;
    uint32_t reserved;
};

__device__ __forceinline__ BatchEntry load_entry(const uint32_t* __restrict__ entries, uint32_t e) {
    const uint4 v = reinterpret_cast<const uint4*>(entries)[e];
    return BatchEntry{v.x, v.y, v.z, v.w};
}

__device__ __forceinline__ bool entry_is_pad(const BatchEntry& b) { return b.slot == BATCH_PAD; }

__device__ __forceinline__ uint32_t pools_per_slot(uint32_t slot_rows, uint32_t kpool) {
    const uint32_t p = slot_rows / kpool;
    return p > 0 ? p : 1u;
}

__device__ __forceinline__ uint32_t blocks_per_slot(uint32_t slot_rows, uint32_t block_size) {
    return (slot_rows + block_size - 1) / block_size;
}
