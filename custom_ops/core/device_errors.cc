// The process-wide CUDA error word and the labels it names (Note [CUDA deferred errors] in
// ortkv/core.h). The op library allocates the word (it links the CUDA runtime; the core does not).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "ortkv/core.h"
#include "ortkv/status.h"

namespace {

struct Label {
  std::string op, node, tensor;
};

struct Labels {
  std::mutex mu;
  std::vector<Label> all;
};

Labels& labels() {
  static Labels* l = new Labels();  // never destroyed: kernels may run during teardown
  return *l;
}

constexpr int kMaxPairs = 1024;
std::atomic<ortkv_device_error*> g_words[kMaxPairs];
std::atomic<int> g_count{0};
std::mutex g_add_mu;

}  // namespace

void ortkv_core_add_device_error(ortkv_device_error* host) {
  std::lock_guard<std::mutex> lock(g_add_mu);
  const int n = g_count.load(std::memory_order_relaxed);
  if (n >= kMaxPairs) return;
  g_words[n].store(host, std::memory_order_release);
  g_count.store(n + 1, std::memory_order_release);
}

ortkv_device_error* ortkv_core_device_error(void) {
  return g_count.load(std::memory_order_acquire) > 0 ? g_words[0].load(std::memory_order_acquire) : nullptr;
}

int32_t ortkv_core_register_label(const char* op, const char* node, const char* tensor) {
  Labels& l = labels();
  std::lock_guard<std::mutex> lock(l.mu);
  for (size_t i = 0; i < l.all.size(); ++i) {
    if (l.all[i].op == op && l.all[i].node == node && l.all[i].tensor == tensor) return static_cast<int32_t>(i);
  }
  l.all.push_back(Label{op, node, tensor});
  return static_cast<int32_t>(l.all.size() - 1);
}

int ortkv_core_device_error_pending(void) {
  const int n = g_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    const ortkv_device_error* w = g_words[i].load(std::memory_order_acquire);
    if (*reinterpret_cast<const volatile int32_t*>(&w[0].code) != ORTKV_DERR_NONE ||
        *reinterpret_cast<const volatile int32_t*>(&w[1].code) != ORTKV_DERR_NONE)
      return 1;
  }
  return 0;
}

namespace {
int TakeFrom(ortkv_device_error* words, char* msg, size_t cap);
}

int ortkv_core_take_device_error(char* msg, size_t cap) {
  const int n = g_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    const int code = TakeFrom(g_words[i].load(std::memory_order_acquire), msg, cap);
    if (code != ORTKV_DERR_NONE) return code;
  }
  return ORTKV_DERR_NONE;
}

namespace {
// Clears both words' codes and nothing else (Note [Reports taken by their codes] in ortkv/core.h).
void ClearWords(ortkv_device_error* words) {
  for (int i = 0; i < 2; ++i) *reinterpret_cast<volatile int32_t*>(&words[i].code) = 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// A taken report's end, for the dense and the paged messages alike: the tagged text (`body` and where it was
// found) into msg (at most cap - 1 characters and a zero), the words' codes cleared; returns `code`.
int Deliver(ortkv_device_error* words, int code, ortkv::Code c, const std::string& body, char* msg, size_t cap) {
  const std::string text =
      ortkv::Status(c, body + " (found on the device by the CUDA kernel and reported after the run; Note [CUDA "
                              "deferred errors])").Tagged();
  if (msg != nullptr && cap > 0) {
    const size_t n = std::min(cap - 1, text.size());
    std::memcpy(msg, text.data(), n);
    msg[n] = '\0';
  }
  ClearWords(words);
  return code;
}

// The paged ops' reports (fields: Note [Paged CUDA] in ortkv/paged_cuda.h); label.tensor holds the
// pool, directory, page table (and page_fill, when the node has it) names separated by newlines; a
// PagedRotaryCacheUpdate's also page_fill's (empty when absent) and then qkv's (Note [PagedRotaryCacheUpdate]).
int FinishPaged(ortkv_device_error* words, const ortkv_device_error& e, int code, const Label& label, char* msg,
                size_t cap) {
  std::string names[6] = {"pool", "directory", "page_table", "page_fill", "", ""};
  {
    size_t at = 0;
    for (int i = 0; i < 6; ++i) {
      const size_t nl = label.tensor.find('\n', at);
      names[i] = label.tensor.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
      if (nl == std::string::npos) break;
      at = nl + 1;
    }
  }
  const bool update = label.op == "PagedCacheUpdate" || label.op == "PagedRotaryCacheUpdate";
  const char* what = update ? "position" : "start";
  const char* tail = update ? " Nothing was written." : " The output of that run is not valid (refused pages were not read).";
  static const char* kFormats[8] = {"F16", "BF16", "INT8", "FP8_E4M3", "INT4", "INT2", "INT4_KC", "INT2_KC"};
  ortkv::Code c = ortkv::Code::kInvalidArgument;
  std::ostringstream m;
  m << label.op << " node '" << label.node << "': ";
  switch (code) {
    case ORTKV_DERR_NEGATIVE:
      m << what << " " << e.position << " for row " << e.row << " is negative; positions start at 0." << tail;
      break;
    case ORTKV_DERR_CAPACITY:
      c = ortkv::Code::kCapacity;
      if (e.first == 2) {  // PagedRotaryCacheUpdate: the rotary tables' rows (Note [PagedRotaryCacheUpdate])
        m << "row " << e.row << ": " << what << " " << e.position << " + tokens " << e.n << " = " << e.position + e.n
          << " exceeds the rotary table '" << names[5] << "' of " << e.capacity << " rows (a row per position)."
          << tail << " Remedy: build the rotary tables with >= " << e.position + e.n << " rows.";
      } else if (e.first == 1) {  // page_fill bound (Note [Page fill]): the row's capacity is its total fill
        m << "row " << e.row << ": " << what << " " << e.position << " + tokens " << e.n << " = " << e.position + e.n
          << " exceeds the row's total fill of " << e.capacity << " tokens (the sum of page_fill '" << names[3]
          << "' over its entries)." << tail << " Remedy: give the row entries (and fill) for its new tokens.";
      } else {
        m << "row " << e.row << ": " << what << " " << e.position << " + tokens " << e.n << " = " << e.position + e.n
          << " exceeds the page table's capacity of " << e.capacity << " tokens ('" << names[2] << "')." << tail
          << " Remedy: widen the page table.";
      }
      break;
    case ORTKV_DERR_PAGE: {
      // problem 8 (the page_format attribute) holds that attribute's format in bits 4..7 of its byte
      const int problem = static_cast<int>(e.last & 0xF), fmt = static_cast<int>((e.last >> 8) & 0xFF);
      const int hint = static_cast<int>((e.last >> 4) & 0xF);
      const uint64_t off = e.last >> 16;
      const int64_t id = static_cast<int64_t>(e.first);
      if (problem == 7) {  // Note [Page fill]: the fill value is in the offset field
        m << "page_fill '" << names[3] << "' row " << e.row << " entry " << e.hit_addr << " is "
          << static_cast<int32_t>(static_cast<uint32_t>(off)) << ", outside [0, page_size] (the rows of the entry's "
          << "page that the row holds). Remedy: fix the fill." << tail;
        break;
      }
      m << "row " << e.row << " (" << what << " " << e.position << ", " << e.n << " tokens) needs page " << e.hit_addr
        << " of its page table '" << names[2] << "' but ";
      switch (problem) {
        case 1: m << "the entry is " << id << " (no page). Remedy: allocate the page and write its id into the page table before the run."; break;
        case 2: m << "page id " << id << " is outside the directory '" << names[1] << "'. Remedy: grow the directory or fix the page table."; break;
        case 3: m << "directory '" << names[1] << "' gives page " << id << " format " << fmt << ", not a page format (0 F16 .. 7 INT2_KC). Remedy: fix the directory entry."; break;
        case 4: m << "page " << id << " is " << (fmt < 8 ? kFormats[fmt] : "?") << ", which cannot pack this head size. Remedy: store such pages as F16/BF16/INT8/FP8_E4M3."; break;
        case 5: m << "directory '" << names[1] << "' places page " << id << " (" << (fmt < 8 ? kFormats[fmt] : "?") << ") at offset " << off << ", which is not a multiple of 16 or not inside the pool '" << names[0] << "'. Remedy: fix the directory entry or bind the whole pool."; break;
        case 8: m << "page " << id << " is " << (fmt < 8 ? kFormats[fmt] : "?") << ", not " << (hint < 8 ? kFormats[hint] : "?") << ", the format the node's page_format attribute promises for every page ('" << names[1] << "'). Remedy: keep every page of this cache in that format (no requantize or demotion), or drop the attribute (pages of any format)."; break;
        default: m << "page " << id << " is " << (fmt < 8 ? kFormats[fmt] : "?") << ": its keys are scaled per channel over the whole page, so key rows cannot be written alone. Remedy: fill the page as F16/BF16 and requantize it when full (paged_requantize)."; break;
      }
      m << tail;
      break;
    }
    case ORTKV_DERR_SHARED_ROW:
      m << "rows " << e.hit_addr << " and " << e.row << " both write row " << e.last << " of page " << e.first
        << " (a page shared by two sequences). Remedy: give each writing sequence its own copy of the page (copy on write)." << tail;
      break;
    case ORTKV_DERR_ENCODE: {
      const int r = static_cast<int>(e.last & 0xFF), kv = static_cast<int>((e.last >> 8) & 0xFF);
      const int fmt = static_cast<int>((e.last >> 16) & 0xFF);
      if (names[4].empty()) {
        m << "'" << (kv ? "value" : "key") << "'";
      } else {
        m << "'" << names[4] << "' (" << (kv ? "v" : "rotated k") << " columns)";
      }
      m << " [row " << e.row << ", position " << e.position << ", head " << e.hit_addr
        << "] into page " << e.first << " (" << (fmt < 8 ? kFormats[fmt] : "?") << "): "
        << (r == 1 ? "holds inf or NaN; the scaled formats refuse non-finite values (store the page as F16/BF16, or fix the values)."
                   : "needs a scale or minimum beyond float16 (|x| too large); store the page as BF16.")
        << tail;
      break;
    }
    default: {
      const bool ro = code == ORTKV_DERR_READONLY;
      c = ro ? ortkv::Code::kReadOnly : ortkv::Code::kUncommitted;
      char lab[128] = {0};
      uintptr_t hit = 0;
      uint64_t hit_len = 0;
      ortkv_core_find_protected(ORTKV_DEVICE_CUDA, 0, static_cast<uintptr_t>(e.hit_addr), 1, 0, &hit, &hit_len, lab,
                                sizeof(lab));
      m << "row " << e.row << " token " << e.position << " would write into the page layer [0x" << std::hex << e.first
        << ", 0x" << e.last << ") of '" << names[0] << "', which overlaps the " << (ro ? "write-protected" : "uncommitted")
        << " range [0x" << e.hit_addr << std::dec << ", +" << hit_len << " bytes) '" << lab << "'." << tail
        << " Remedy: " << (ro ? "give the sequence its own copy of the page (copy on write)." : "commit the page's slot before the run.");
      break;
    }
  }
  return Deliver(words, code, c, m.str(), msg, cap);
}

int TakeFrom(ortkv_device_error* words, char* msg, size_t cap) {
  ortkv_device_error* w = words;  // CacheUpdate's word first, then CacheAttention's
  int32_t code = *reinterpret_cast<volatile int32_t*>(&w->code);
  if (code == ORTKV_DERR_NONE) {
    w = words + 1;
    code = *reinterpret_cast<volatile int32_t*>(&w->code);
  }
  if (code == ORTKV_DERR_NONE) return 0;
  std::atomic_thread_fence(std::memory_order_acquire);
  const ortkv_device_error e = *w;
  Label label{"an ortkv op", "?", "the cache"};
  {
    Labels& l = labels();
    std::lock_guard<std::mutex> lock(l.mu);
    if (e.label >= 0 && static_cast<size_t>(e.label) < l.all.size()) label = l.all[e.label];
  }
  std::ostringstream m;
  if (label.op.rfind("Paged", 0) == 0) return FinishPaged(words, e, code, label, msg, cap);
  const bool update = label.op == "CacheUpdate" || label.op == "RotaryCacheUpdate";  // both write word [0]
  const char* what = update ? "position" : "start";
  const char* tail = update ? " Nothing was written" : " The output of that run is not valid (reads were clamped to the cache)";
  ortkv::Code c = ortkv::Code::kInvalidArgument;
  m << label.op << " node '" << label.node << "': ";
  switch (code) {
    case ORTKV_DERR_NEGATIVE:
      m << what << " " << e.position << " for row " << e.row << " of '" << label.tensor
        << "' is negative; positions start at 0." << tail;
      break;
    case ORTKV_DERR_CAPACITY: {
      c = ortkv::Code::kCapacity;
      const uint64_t end = static_cast<uint64_t>(e.position) + static_cast<uint64_t>(e.n);
      m << "row " << e.row << ": " << what << " " << e.position << " + n " << e.n << " = " << end
        << " exceeds capacity " << e.capacity << " of '" << label.tensor << "'." << tail
        << ". Remedy: evict or start a new sequence, or allocate a cache with capacity >= " << end;
      break;
    }
    default: {
      const bool ro = code == ORTKV_DERR_READONLY;
      c = ro ? ortkv::Code::kReadOnly : ortkv::Code::kUncommitted;
      char lab[128] = {0};
      uintptr_t hit = 0;
      uint64_t hit_len = 0;
      ortkv_core_find_protected(ORTKV_DEVICE_CUDA, 0, static_cast<uintptr_t>(e.hit_addr), 1, 0, &hit, &hit_len, lab,
                                sizeof(lab));
      m << "row " << e.row << " of '" << label.tensor << "' would write [0x" << std::hex << e.first << ", 0x" << e.last
        << ") which overlaps the " << (ro ? "write-protected" : "uncommitted") << " range [0x" << e.hit_addr << std::dec
        << ", +" << hit_len << " bytes) '" << lab << "'." << tail << ". Remedy: "
        << (ro ? "bind the owner's writable storage, or fork the sequence into its own pages."
               : "commit the arena up to the last token before the run (Arena.commit).");
      break;
    }
  }
  return Deliver(words, code, c, m.str(), msg, cap);
}
}  // namespace
