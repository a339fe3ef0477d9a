// Exact GPT-2 byte-level BPE encoder (built by `pip install -e .` as
// megatron.tokenizer.bpe_engine; the Python glue is megatron/tokenizer/native_bpe.py).
//
// The token ids are those of the pure-Python reference (tests/tokenizer/reference_bpe.py):
//   1. pre-tokenize with GPT-2's regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      emulated by a hand-written scanner over UTF-8 (see `match_end`); the character classes
//      \p{L}, \p{N} and \s come from the caller as code point ranges, computed from Python's
//      `regex` module, so they match the reference exactly;
//   2. BPE-merge the bytes of each piece, lowest-rank pair first, all occurrences of that pair
//      left to right (see `bpe_word`), with a per-engine cache of piece bytes -> token ids.
//
// The constructor takes plain data only (no file I/O): token bytes by id, merges as
// (left_id, right_id, merged_id) in rank order, the id of each single byte, and the ranges.
//
// Threads: `encode` releases the GIL. The word cache is per engine and guarded by a mutex, so
// concurrent calls on one engine are safe but run one at a time; for parallel encoding use one
// engine per thread.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "bpe_tables.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using bpe::kNoMerge;
using bpe::packed_id;
using bpe::packed_rank;
using bpe::PairTable;
using bpe::WordCache;

constexpr uint32_t kNumCodePoints = 0x110000;

// Character class bits. kOther is set exactly when none of the three regex classes is, so it is
// the class [^\s\p{L}\p{N}] of the pattern's fourth alternative.
constexpr uint8_t kLetter = 1;  // \p{L}
constexpr uint8_t kNumber = 2;  // \p{N}
constexpr uint8_t kSpace = 4;   // \s
constexpr uint8_t kOther = 8;   // [^\s\p{L}\p{N}]

// Decodes the code point starting at s[i]. The input is valid UTF-8 (it comes from Python's
// encoder), so the lead byte alone gives the length.
inline uint32_t decode_utf8(const uint8_t* s, size_t i, size_t& length) {
  const uint32_t b = s[i];
  if (b < 0x80) {
    length = 1;
    return b;
  }
  if (b < 0xE0) {
    length = 2;
    return ((b & 0x1F) << 6) | (s[i + 1] & 0x3F);
  }
  if (b < 0xF0) {
    length = 3;
    return ((b & 0x0F) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3F);
  }
  length = 4;
  return ((b & 0x07) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) |
         (s[i + 3] & 0x3F);
}

// Reads a [k, 2] int64 array of half-open code point ranges.
std::vector<std::pair<int64_t, int64_t>> read_ranges(const py::handle& obj, const char* name) {
  auto array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!array || array.ndim() != 2 || array.shape(1) != 2) {
    throw py::value_error(std::string(name) + " must be an int64 array of shape [k, 2]");
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  const int64_t* data = array.data();
  for (py::ssize_t k = 0; k < array.shape(0); ++k) {
    const int64_t lo = data[2 * k];
    const int64_t hi = data[2 * k + 1];
    if (lo < 0 || hi > kNumCodePoints || lo >= hi) {
      throw py::value_error(std::string(name) + ": row " + std::to_string(k) + " [" +
                            std::to_string(lo) + ", " + std::to_string(hi) +
                            ") is not a non-empty range inside [0, 0x110000)");
    }
    ranges.emplace_back(lo, hi);
  }
  return ranges;
}

int64_t read_int(PyObject* obj, const char* what) {
  const long long value = PyLong_AsLongLong(obj);
  if (value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be an int");
  }
  return value;
}

// ---------------------------------------------------------------------------------------------
class BPEEngine {
 public:
  BPEEngine(const py::list& token_bytes, const py::list& merges, const py::sequence& byte_ids,
            const py::handle& letter_ranges, const py::handle& number_ranges,
            const py::handle& space_ranges, bool force_reference_order) {
    // Token bytes, flattened into one arena (only needed here, for validation).
    const size_t vocab_size = token_bytes.size();
    if (vocab_size >= (size_t{1} << 31)) throw py::value_error("too many tokens");
    std::vector<size_t> offsets(vocab_size + 1, 0);
    std::string arena;
    for (size_t id = 0; id < vocab_size; ++id) {
      PyObject* item = PyList_GET_ITEM(token_bytes.ptr(), static_cast<py::ssize_t>(id));
      if (!PyBytes_Check(item)) {
        throw py::type_error("token_bytes[" + std::to_string(id) + "] must be bytes");
      }
      arena.append(PyBytes_AS_STRING(item), static_cast<size_t>(PyBytes_GET_SIZE(item)));
      offsets[id + 1] = arena.size();
    }
    auto bytes_of = [&](size_t id) {
      return std::string_view(arena.data() + offsets[id], offsets[id + 1] - offsets[id]);
    };
    // `describe` names the value in the error message; it is only called on error.
    auto check_id = [&](int64_t id, const auto& describe) {
      if (id < 0 || static_cast<size_t>(id) >= vocab_size) {
        throw py::value_error(describe() + " = " + std::to_string(id) +
                              " is not a token id in [0, " + std::to_string(vocab_size) + ")");
      }
      return static_cast<uint32_t>(id);
    };

    // Single bytes.
    if (py::len(byte_ids) != 256) throw py::value_error("byte_ids must have 256 entries");
    for (int b = 0; b < 256; ++b) {
      const py::object item = byte_ids[static_cast<size_t>(b)];
      const std::string what = "byte_ids[" + std::to_string(b) + "]";
      byte_id_[b] = check_id(read_int(item.ptr(), what.c_str()), [&] { return what; });
      const std::string_view bytes = bytes_of(byte_id_[b]);
      if (bytes.size() != 1 || static_cast<uint8_t>(bytes[0]) != b) {
        throw py::value_error(what + ": token_bytes of that id is not the single byte " +
                              std::to_string(b));
      }
    }

    // Merges: validate, then fill the pair table (a later duplicate pair overrides the earlier
    // one, like the reference's {pair: rank} dict comprehension).
    const size_t num_merges = merges.size();
    if (num_merges >= (size_t{1} << 31)) throw py::value_error("too many merges");
    merge_left_.resize(num_merges);
    merge_right_.resize(num_merges);
    std::vector<uint32_t> merge_result(num_merges);
    pairs_.init(num_merges);
    for (size_t rank = 0; rank < num_merges; ++rank) {
      const auto what = [rank] { return "merges[" + std::to_string(rank) + "]"; };
      const py::tuple triple(py::reinterpret_borrow<py::object>(
          PyList_GET_ITEM(merges.ptr(), static_cast<py::ssize_t>(rank))));
      if (triple.size() != 3) throw py::value_error(what() + " must be (left, right, merged)");
      int64_t raw[3];
      for (int k = 0; k < 3; ++k) raw[k] = read_int(triple[k].ptr(), "merges entries");
      const uint32_t left = check_id(raw[0], [&] { return what() + "[0]"; });
      const uint32_t right = check_id(raw[1], [&] { return what() + "[1]"; });
      const uint32_t merged = check_id(raw[2], [&] { return what() + "[2]"; });
      const std::string_view lb = bytes_of(left), rb = bytes_of(right), mb = bytes_of(merged);
      if (lb.empty() || rb.empty() || mb.size() != lb.size() + rb.size() ||
          mb.substr(0, lb.size()) != lb || mb.substr(lb.size()) != rb) {
        throw py::value_error(what() + ": token_bytes[merged] must be token_bytes[left] + "
                              "token_bytes[right], both non-empty");
      }
      merge_left_[rank] = left;
      merge_right_[rank] = right;
      merge_result[rank] = merged;
      pairs_.set(left, right, (static_cast<uint64_t>(rank) << 32) | merged);
    }

    // The heap/linked-list merge (fast_merge_) processes pairs in (rank, position) order one at
    // a time. It equals the reference (min-rank pair, all occurrences left to right) when a
    // merge never creates a pair that ranks before itself, i.e. when every merge that uses a
    // token ranks after every merge that produces it: then merging rank r only creates pairs of
    // rank > r, so all rank-r occurrences are merged, left to right, before anything else.
    // Overlapping occurrences (pair (x, x) in "x x x") resolve the same way in both: the left
    // one merges and the right one loses its left symbol. (Single bytes are never produced: a
    // merged token has at least two bytes.)
    fast_merge_ = !force_reference_order;
    if (fast_merge_) {
      std::vector<int64_t> last_producer(vocab_size, -1);
      std::vector<int64_t> first_user(vocab_size, INT64_MAX);
      for (size_t rank = 0; rank < num_merges; ++rank) {
        const uint64_t packed = pairs_.get(merge_left_[rank], merge_right_[rank]);
        if (packed_rank(packed) != rank) continue;  // overridden duplicate: never applies
        const int64_t r = static_cast<int64_t>(rank);
        last_producer[merge_result[rank]] = std::max(last_producer[merge_result[rank]], r);
        first_user[merge_left_[rank]] = std::min(first_user[merge_left_[rank]], r);
        first_user[merge_right_[rank]] = std::min(first_user[merge_right_[rank]], r);
      }
      for (size_t id = 0; id < vocab_size && fast_merge_; ++id) {
        if (last_producer[id] >= first_user[id]) fast_merge_ = false;
      }
    }

    // Character classes: one byte per code point (1.1 MB), ASCII at the front.
    classes_.assign(kNumCodePoints, 0);
    const std::pair<const py::handle*, uint8_t> tables[] = {
        {&letter_ranges, kLetter}, {&number_ranges, kNumber}, {&space_ranges, kSpace}};
    const char* names[] = {"letter_ranges", "number_ranges", "space_ranges"};
    for (int t = 0; t < 3; ++t) {
      for (const auto& [lo, hi] : read_ranges(*tables[t].first, names[t])) {
        for (int64_t cp = lo; cp < hi; ++cp) classes_[static_cast<size_t>(cp)] |= tables[t].second;
      }
    }
    for (uint8_t& c : classes_) {
      if (c == 0) c = kOther;
    }
  }

  // Token ids of `text` (a str) as an int32 array.
  py::array_t<int32_t> encode(const py::handle& text) {
    PyObject* obj = text.ptr();
    if (!PyUnicode_Check(obj)) throw py::type_error("encode() expects a str");
    const uint8_t* data;
    size_t size;
    py::object utf8;  // keeps a UTF-8 copy alive for non-ASCII text
    if (PyUnicode_IS_ASCII(obj)) {
      // ASCII strings store their characters as one byte each: that already is the UTF-8.
      data = static_cast<const uint8_t*>(PyUnicode_DATA(obj));
      size = static_cast<size_t>(PyUnicode_GET_LENGTH(obj));
    } else {
      // Raises UnicodeEncodeError ("surrogates not allowed") for lone surrogates.
      PyObject* bytes = PyUnicode_AsUTF8String(obj);
      if (bytes == nullptr) throw py::error_already_set();
      utf8 = py::reinterpret_steal<py::object>(bytes);
      data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(bytes));
      size = static_cast<size_t>(PyBytes_GET_SIZE(bytes));
    }

    auto ids = std::make_unique<std::vector<int32_t>>();
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mutex_);  // released before the GIL is re-acquired
      ids->reserve(size / 4 + 16);
      for (size_t i = 0; i < size;) {
        const size_t end = match_end(data, size, i);
        encode_piece(data + i, end - i, *ids);
        i = end;
      }
    }
    // The array takes ownership of the vector's buffer (no copy).
    py::capsule owner(ids.get(), [](void* p) { delete static_cast<std::vector<int32_t>*>(p); });
    const std::vector<int32_t>* raw = ids.release();
    return py::array_t<int32_t>({static_cast<py::ssize_t>(raw->size())}, raw->data(), owner);
  }

  bool fast_merge() const { return fast_merge_; }

  size_t cache_size() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    return cache_.size();
  }

  void clear_cache() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    cache_.clear();
  }

 private:
  uint8_t class_at(const uint8_t* s, size_t i, size_t& length) const {
    return classes_[decode_utf8(s, i, length)];
  }

  // End of the run of characters whose class intersects `mask`, starting at byte i.
  size_t run_end(const uint8_t* s, size_t n, size_t i, uint8_t mask) const {
    while (i < n) {
      const uint8_t b = s[i];
      if (b < 0x80) {  // ASCII fast path: no decoding
        if (!(classes_[b] & mask)) break;
        ++i;
      } else {
        size_t length;
        if (!(class_at(s, i, length) & mask)) break;
        i += length;
      }
    }
    return i;
  }

  // End (byte offset) of the regex match that starts at byte i < n. The alternatives are
  // tried in the pattern's order; each comment gives the alternative and how the regex engine
  // backtracks on it.
  size_t match_end(const uint8_t* s, size_t n, size_t i) const {
    const uint8_t b = s[i];

    // 's|'t|'re|'ve|'m|'ll|'d : lowercase literals only; they are tried only here, at the
    // start of a match (an apostrophe inside a run of punctuation is part of that run).
    if (b == '\'' && i + 1 < n) {
      const uint8_t c = s[i + 1];
      if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
      if (i + 2 < n && ((c == 'r' && s[i + 2] == 'e') || (c == 'v' && s[i + 2] == 'e') ||
                        (c == 'l' && s[i + 2] == 'l'))) {
        return i + 3;
      }
    }

    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: ` ?` is U+0020 only and greedy. With a
    // space here, the run may start after it; if the next character is not in the class the
    // engine backtracks to an empty ` ?` and the run must start at the space itself.
    size_t length0;
    const uint8_t class0 = class_at(s, i, length0);
    const bool space = b == ' ' && i + 1 < n;
    size_t length1 = 0;
    const uint8_t class1 = space ? class_at(s, i + 1, length1) : 0;
    for (const uint8_t mask : {kLetter, kNumber, kOther}) {
      if (class1 & mask) return run_end(s, n, i + 1 + length1, mask);
      if (class0 & mask) return run_end(s, n, i + length0, mask);
    }

    // Only \s is left (every character is in \p{L}, \p{N}, \s or the "other" class).
    // `\s+(?!\S)`: the greedy run [i, j) is followed by the end of text (match it all) or by a
    // non-space at j, where the lookahead fails; backtracking one character puts a space at
    // the new end, so the match is the run minus its last character, if that is not empty.
    // `\s+`: otherwise (a single whitespace character before a non-space) the whole run.
    size_t last = i;  // start of the run's last character
    size_t j = i + length0;
    while (j < n) {
      size_t length;
      if (!(class_at(s, j, length) & kSpace)) break;
      last = j;
      j += length;
    }
    if (j == n) return n;
    return last > i ? last : j;
  }

  // Appends the ids of one pre-tokenized piece, through the word cache.
  void encode_piece(const uint8_t* p, size_t n, std::vector<int32_t>& out) {
    if (n == 1) {
      out.push_back(static_cast<int32_t>(byte_id_[p[0]]));
      return;
    }
    if (n > WordCache::kMaxKeyLength) {
      // bpe_heap indexes bytes with uint32 (a ValueError in Python, never reached in practice).
      if (n >= UINT32_MAX) throw std::length_error("a pre-tokenized piece of 4 GiB or more");
      bpe_word(p, n, out);
      return;
    }
    const uint64_t h = WordCache::hash(p, n);
    if (cache_.lookup(p, n, h, out)) return;
    const size_t before = out.size();
    bpe_word(p, n, out);
    cache_.insert(p, n, h, out.data() + before, out.size() - before);
  }

  uint64_t pair(uint32_t left, uint32_t right) const { return pairs_.get(left, right); }

  // BPE of one piece (n >= 2 bytes); appends the ids to `out`.
  void bpe_word(const uint8_t* p, size_t n, std::vector<int32_t>& out) {
    if (!fast_merge_) {
      bpe_reference_order(p, n, out);
    } else if (n <= kSmallWord) {
      bpe_small(p, n, out);
    } else {
      bpe_heap(p, n, out);
    }
  }

  // Fast path for short pieces: merge the leftmost lowest-rank pair, one at a time, in arrays.
  // O(n^2), but n <= kSmallWord. Same order as bpe_heap (see the constructor for why it
  // equals the reference when fast_merge_ is set).
  static constexpr size_t kSmallWord = 48;
  void bpe_small(const uint8_t* p, size_t n, std::vector<int32_t>& out) const {
    uint32_t symbols[kSmallWord];
    uint64_t merges[kSmallWord];  // merges[k]: packed merge of (symbols[k], symbols[k + 1])
    for (size_t k = 0; k < n; ++k) symbols[k] = byte_id_[p[k]];
    for (size_t k = 0; k + 1 < n; ++k) merges[k] = pair(symbols[k], symbols[k + 1]);
    size_t m = n;
    while (m > 1) {
      size_t best = 0;
      for (size_t k = 1; k + 1 < m; ++k) {
        if (merges[k] < merges[best]) best = k;
      }
      if (merges[best] == kNoMerge) break;
      symbols[best] = packed_id(merges[best]);
      // Drop symbols[best + 1] and merges[best + 1] (the pair it formed with its right
      // neighbour, whose right symbol becomes best's new neighbour).
      std::memmove(symbols + best + 1, symbols + best + 2, (m - best - 2) * sizeof(uint32_t));
      if (best + 2 < m - 1) {
        std::memmove(merges + best + 1, merges + best + 2, (m - best - 3) * sizeof(uint64_t));
      }
      --m;
      if (best > 0) merges[best - 1] = pair(symbols[best - 1], symbols[best]);
      if (best + 1 < m) merges[best] = pair(symbols[best], symbols[best + 1]);
    }
    for (size_t k = 0; k < m; ++k) out.push_back(static_cast<int32_t>(symbols[k]));
  }

  // Fast path for long pieces: symbols in a doubly linked list over byte positions, candidate
  // pairs in a min-heap keyed by (rank << 32 | position of the left symbol). Entries that no
  // longer describe the current pair at that position are skipped when popped. O(n log n).
  void bpe_heap(const uint8_t* p, size_t n, std::vector<int32_t>& out) {
    constexpr uint32_t kNone = ~uint32_t{0};
    std::vector<uint32_t>& symbols = scratch_symbols_;
    std::vector<uint32_t>& prev = scratch_prev_;
    std::vector<uint32_t>& next = scratch_next_;
    std::vector<uint64_t>& heap = scratch_heap_;
    symbols.resize(n);
    prev.resize(n);
    next.resize(n);
    heap.clear();
    for (size_t k = 0; k < n; ++k) {
      symbols[k] = byte_id_[p[k]];
      prev[k] = k == 0 ? kNone : static_cast<uint32_t>(k - 1);
      next[k] = k + 1 == n ? kNone : static_cast<uint32_t>(k + 1);
    }
    const auto push = [&](uint32_t pos) {
      const uint64_t merge = pair(symbols[pos], symbols[next[pos]]);
      if (merge != kNoMerge) {
        heap.push_back((static_cast<uint64_t>(packed_rank(merge)) << 32) | pos);
        std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
      }
    };
    for (size_t k = 0; k + 1 < n; ++k) push(static_cast<uint32_t>(k));
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
      const uint64_t top = heap.back();
      heap.pop_back();
      const uint32_t pos = static_cast<uint32_t>(top);
      const uint32_t right = next[pos];
      if (symbols[pos] == kNone || right == kNone) continue;  // stale: merged away
      // Stale if the pair at pos changed since the push: symbols only grow, so the same
      // (rank) means the same pair.
      const uint64_t merge = pair(symbols[pos], symbols[right]);
      if (merge == kNoMerge || packed_rank(merge) != static_cast<uint32_t>(top >> 32)) continue;
      symbols[pos] = packed_id(merge);
      symbols[right] = kNone;
      next[pos] = next[right];
      if (next[pos] != kNone) prev[next[pos]] = pos;
      if (prev[pos] != kNone) push(prev[pos]);
      if (next[pos] != kNone) push(pos);
    }
    for (uint32_t k = 0; k != kNone; k = next[k]) out.push_back(static_cast<int32_t>(symbols[k]));
  }

  // The reference's own order, used when the merge table does not allow the fast paths:
  // repeatedly find the lowest-rank adjacent pair and merge all its occurrences, left to right.
  void bpe_reference_order(const uint8_t* p, size_t n, std::vector<int32_t>& out) {
    std::vector<uint32_t>& symbols = scratch_symbols_;
    symbols.resize(n);
    for (size_t k = 0; k < n; ++k) symbols[k] = byte_id_[p[k]];
    size_t m = n;
    while (m > 1) {
      uint64_t best = kNoMerge;
      for (size_t k = 0; k + 1 < m; ++k) best = std::min(best, pair(symbols[k], symbols[k + 1]));
      if (best == kNoMerge) break;
      const uint32_t first = merge_left_[packed_rank(best)];
      const uint32_t second = merge_right_[packed_rank(best)];
      size_t w = 0;
      for (size_t k = 0; k < m;) {
        if (k + 1 < m && symbols[k] == first && symbols[k + 1] == second) {
          symbols[w++] = packed_id(best);
          k += 2;
        } else {
          symbols[w++] = symbols[k++];
        }
      }
      m = w;
    }
    for (size_t k = 0; k < m; ++k) out.push_back(static_cast<int32_t>(symbols[k]));
  }

  std::vector<uint8_t> classes_;  // class bits by code point
  uint32_t byte_id_[256];
  PairTable pairs_;
  std::vector<uint32_t> merge_left_, merge_right_;  // by rank
  bool fast_merge_ = false;

  std::mutex mutex_;  // guards everything below
  WordCache cache_;
  std::vector<uint32_t> scratch_symbols_, scratch_prev_, scratch_next_;
  std::vector<uint64_t> scratch_heap_;
};

}  // namespace

PYBIND11_MODULE(bpe_engine, m) {
  m.doc() = "Exact GPT-2 byte-level BPE encoder (see megatron/tokenizer/native_bpe.py).";
  py::class_<BPEEngine>(m, "BPEEngine", R"doc(
GPT-2 byte-level BPE encoder with the token ids of the reference algorithm.

Built from plain data (megatron.tokenizer.native_bpe.build_native_engine does this from a
vocab and merges): token_bytes (list of bytes, index = id, b"" for special tokens),
merges (list of (left_id, right_id, merged_id) in rank order), byte_ids (id of each byte
value), and int64 [k, 2] arrays of half-open code point ranges for \p{L}, \p{N} and \s.
With force_reference_order=True the merge step always uses the reference's own order
(slower; for testing). encode() releases the GIL; calls on one engine are serialized by a
mutex guarding its word cache, so use one engine per thread to encode in parallel.
)doc")
      .def(py::init<const py::list&, const py::list&, const py::sequence&, const py::handle&,
                    const py::handle&, const py::handle&, bool>(),
           py::arg("token_bytes"), py::arg("merges"), py::arg("byte_ids"),
           py::arg("letter_ranges"), py::arg("number_ranges"), py::arg("space_ranges"),
           py::kw_only(), py::arg("force_reference_order") = false)
      .def("encode", &BPEEngine::encode, py::arg("text"),
           "Token ids of `text` as an int32 numpy array (special tokens in the text are plain "
           "text). Raises UnicodeEncodeError for text with lone surrogates.")
      .def_property_readonly("fast_merge", &BPEEngine::fast_merge,
                             "Whether the O(n log n) merge (provably equal to the reference "
                             "order for this merge table) is in use.")
      .def_property_readonly("cache_size", &BPEEngine::cache_size,
                             "Number of pieces in the word cache.")
      .def("clear_cache", &BPEEngine::clear_cache, "Empty the word cache.");
}
