// Hash tables of the BPE engine (bpe_engine.cpp): the merge table and the word cache.
// Header-only, included once, by bpe_engine.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace bpe {

// A merge packed as (rank << 32) | merged_id. Ranks are unique per pair, so the smallest packed
// value is the lowest-rank merge. kNoMerge (all ones) means "this pair never merges".
constexpr uint64_t kNoMerge = ~uint64_t{0};

inline uint32_t packed_rank(uint64_t packed) { return static_cast<uint32_t>(packed >> 32); }
inline uint32_t packed_id(uint64_t packed) { return static_cast<uint32_t>(packed); }

// ---------------------------------------------------------------------------------------------
// (left_id, right_id) -> packed merge: open addressing, linear probing, built once.
class PairTable {
 public:
  void init(size_t count) {
    size_t capacity = 16;
    int bits = 4;
    while (capacity < 2 * count + 2) {
      capacity <<= 1;
      ++bits;
    }
    slots_.assign(capacity, Slot{kEmptyKey, kNoMerge});
    mask_ = capacity - 1;
    shift_ = 64 - bits;
  }

  // Inserts or overwrites (a later duplicate pair wins, as in the reference's dict of ranks).
  void set(uint32_t left, uint32_t right, uint64_t value) {
    const uint64_t key = make_key(left, right);
    for (size_t i = index(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key || slots_[i].key == kEmptyKey) {
        slots_[i] = Slot{key, value};
        return;
      }
    }
  }

  uint64_t get(uint32_t left, uint32_t right) const {
    const uint64_t key = make_key(left, right);
    for (size_t i = index(key);; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.key == key) return slot.value;
      if (slot.key == kEmptyKey) return kNoMerge;
    }
  }

 private:
  struct Slot {
    uint64_t key;
    uint64_t value;
  };
  static constexpr uint64_t kEmptyKey = ~uint64_t{0};  // ids are < 2^31, so never a real key

  static uint64_t make_key(uint32_t left, uint32_t right) {
    return (static_cast<uint64_t>(left) << 32) | right;
  }
  size_t index(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 60;
};

// ---------------------------------------------------------------------------------------------
// Word cache: piece bytes -> token ids. Keys and ids live in two arenas; the probe table holds
// (32-bit hash tag << 32) | (entry index + 1), 0 meaning empty. Bounded: it is cleared when it
// reaches kMaxEntries entries or kMaxKeyBytes bytes of keys. Not thread-safe by itself (the
// engine's mutex guards it).
class WordCache {
 public:
  static constexpr size_t kMaxKeyLength = 256;  // longer pieces are not cached
  static constexpr size_t kMaxEntries = size_t{1} << 20;
  static constexpr size_t kMaxKeyBytes = size_t{64} << 20;

  WordCache() { slots_.assign(kInitialSlots, 0); }

  static uint64_t hash(const uint8_t* p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 29;
      p += 8;
      n -= 8;
    }
    if (n > 0) {
      uint64_t w = 0;
      std::memcpy(&w, p, n);
      h = (h ^ w) * 0x94D049BB133111EBull;
      h ^= h >> 31;
    }
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
  }

  // Appends the cached ids of the key to `out`; false if the key is not cached.
  bool lookup(const uint8_t* key, size_t n, uint64_t h, std::vector<int32_t>& out) const {
    const size_t mask = slots_.size() - 1;
    const uint64_t tag = h >> 32;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const uint64_t slot = slots_[i];
      if (slot == 0) return false;
      if ((slot >> 32) == tag) {
        const Entry& e = entries_[static_cast<uint32_t>(slot) - 1];
        if (e.key_length == n && std::memcmp(keys_.data() + e.key_offset, key, n) == 0) {
          out.insert(out.end(), ids_.begin() + e.ids_offset,
                     ids_.begin() + e.ids_offset + e.ids_length);
          return true;
        }
      }
    }
  }

  // Caches ids[0, count) for the key (which must not be cached yet).
  void insert(const uint8_t* key, size_t n, uint64_t h, const int32_t* ids, size_t count) {
    if (entries_.size() >= kMaxEntries || keys_.size() + n > kMaxKeyBytes) clear();
    if (2 * (entries_.size() + 1) > slots_.size()) grow();
    Entry e;
    e.key_offset = static_cast<uint32_t>(keys_.size());
    e.ids_offset = static_cast<uint32_t>(ids_.size());
    e.key_length = static_cast<uint16_t>(n);
    e.ids_length = static_cast<uint16_t>(count);
    keys_.insert(keys_.end(), key, key + n);
    ids_.insert(ids_.end(), ids, ids + count);
    entries_.push_back(e);
    place(h, entries_.size());
  }

  void clear() {
    entries_.clear();
    keys_.clear();
    ids_.clear();
    std::fill(slots_.begin(), slots_.end(), 0);
  }

  size_t size() const { return entries_.size(); }

 private:
  static constexpr size_t kInitialSlots = size_t{1} << 14;
  struct Entry {
    uint32_t key_offset;
    uint32_t ids_offset;
    uint16_t key_length;
    uint16_t ids_length;
  };

  void place(uint64_t h, size_t entry_number) {
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    while (slots_[i] != 0) i = (i + 1) & mask;
    slots_[i] = ((h >> 32) << 32) | entry_number;
  }

  void grow() {
    slots_.assign(slots_.size() * 2, 0);
    for (size_t k = 0; k < entries_.size(); ++k) {
      const Entry& e = entries_[k];
      place(hash(keys_.data() + e.key_offset, e.key_length), k + 1);
    }
  }

  std::vector<uint64_t> slots_;
  std::vector<Entry> entries_;
  std::vector<uint8_t> keys_;
  std::vector<int32_t> ids_;
};

}  // namespace bpe
