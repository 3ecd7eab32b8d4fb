// The emulated device: one host process that holds device memory and runs a
// bundle's kernels built for the host against the CUDA shim (cuda_host.h),
// each kernel instance a shared library exporting `moeforge_emu_launch`
// (the emitted launch table). The runtime drives it over stdin/stdout:
//
//   request: u8 op, then its fields (little-endian)
//     1 alloc  u64 bytes                                -> u32 buffer
//     2 write  u32 buffer, u64 offset, u64 len, bytes   -> nothing
//     3 read   u32 buffer, u64 offset, u64 len          -> bytes
//     4 load   u32 len, path                            -> u32 module
//     5 launch u32 module, u32 len, entry, u32 grid, u32 block, u32 args,
//              per argument u8 kind and its value:
//                0 pointer (u32 buffer, u64 offset), 1 null, 2 i32, 3 i64, 4 f32
//     6 transfer u32 program, u32 buffers, u32 buffer ids..., u64 words,
//              u64 table words...: one batch of a transfer program
//              (moeforge_xfer: the runtime checked every run against the
//              buffers' sizes)                          -> nothing
//     7 load transfer u32 len, path: a transfer program's shared library,
//              LLVM's host code for its IR               -> u32 program
//     8 side transfer: as 6, queued on the side stream  -> u64 event
//     9 wait   u64 event                                -> u64 overlapped
//    10 lazy side stream: from now on it starts a transfer only once a
//              wait asks for it (or at quit), as late as the runtime's
//              waits allow: a legal schedule that makes every main-stream
//              launch and transfer before the wait overlap it -> nothing
//     0 quit (after the side stream drained)
//   reply: u8 0 and the result, or u8 1, u32 len and a message.
//
// Launches and transfers on the main stream run to completion in the order
// they arrive (a launch's blocks one after another, its threads as
// fibers), so any order the program's streams and events allow is
// respected. The side stream is one worker thread running its transfers in
// the order they were queued, beside the main stream: a side transfer's
// event is its place in that queue, and `wait` returns once it and every
// transfer before it finished, with the main-stream launches and transfers
// that finished while side work was queued (the overlap, as timed here).
// The runtime waits before anything touches what a side transfer moves. A
// kernel that traps aborts the process: the runtime reports the launch it
// was running.
#include <dlfcn.h>

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using LaunchFn = int (*)(const char*, unsigned, unsigned, void**);

struct Buffer {
  unsigned char* data;
  uint64_t bytes;
};

std::vector<Buffer> buffers;
std::vector<LaunchFn> modules;
// moeforge_xfer(bases, table, worker, workers): a transfer program's entry.
using TransferFn = void (*)(unsigned char**, const uint64_t*, uint64_t, uint64_t);
std::vector<TransferFn> transfers;

// The side stream: queued transfers, run in order by one worker thread.
struct SideJob {
  TransferFn fn;
  std::vector<unsigned char*> bases;
  std::vector<uint64_t> table;
};
// The worker's state is never destroyed: a process that exits (the runtime
// went away, a malformed request) while the worker waits or runs a job
// just ends, instead of destroying what the worker uses (a joinable
// std::thread's destructor would abort it, a destroyed mutex or condition
// variable the worker holds is undefined).
std::mutex& side_mu = *new std::mutex;
std::condition_variable& side_cv = *new std::condition_variable;
std::deque<SideJob>& side_queue = *new std::deque<SideJob>;
uint64_t side_queued = 0, side_done = 0;
std::thread* side_worker = nullptr;
bool side_quit = false;
// Op 10: the side stream starts a job only once a wait wants it.
bool side_lazy = false;
uint64_t side_wanted = 0;
// Main-stream launches and transfers that finished while side work was queued.
uint64_t overlapped = 0;

void side_loop() {
  std::unique_lock<std::mutex> lock(side_mu);
  for (;;) {
    side_cv.wait(lock, [] {
      return side_quit || (!side_queue.empty() && (!side_lazy || side_wanted > side_done));
    });
    if (side_queue.empty()) return;
    SideJob job = std::move(side_queue.front());
    side_queue.pop_front();
    lock.unlock();
    job.fn(job.bases.data(), job.table.data(), 0, 1);
    lock.lock();
    ++side_done;
    side_cv.notify_all();
  }
}

// Counts one finished main-stream launch or transfer as overlapped when
// side work is queued or running.
void count_overlap() {
  std::lock_guard<std::mutex> lock(side_mu);
  if (side_done < side_queued) ++overlapped;
}

bool read_exact(void* dst, size_t n) { return n == 0 || std::fread(dst, 1, n, stdin) == n; }

template <typename T>
T get() {
  T v{};
  if (!read_exact(&v, sizeof(T))) std::exit(0);  // the runtime went away
  return v;
}

std::string get_string() {
  const uint32_t n = get<uint32_t>();
  if (n > (1u << 20)) std::exit(2);
  std::string s(n, '\0');
  if (!read_exact(s.data(), n)) std::exit(0);
  return s;
}

void ok() { std::fputc(0, stdout); }

void fail(const std::string& why) {
  std::fputc(1, stdout);
  const uint32_t n = static_cast<uint32_t>(why.size());
  std::fwrite(&n, 4, 1, stdout);
  std::fwrite(why.data(), 1, n, stdout);
}

// A range of a buffer, or null when it lies outside.
unsigned char* at(uint32_t id, uint64_t offset, uint64_t len) {
  if (id >= buffers.size()) return nullptr;
  const Buffer& b = buffers[id];
  if (offset > b.bytes || len > b.bytes - offset) return nullptr;
  return b.data + offset;
}

void launch() {
  const uint32_t module = get<uint32_t>();
  const std::string entry = get_string();
  const uint32_t grid = get<uint32_t>(), block = get<uint32_t>(), n = get<uint32_t>();
  if (n > 64) std::exit(2);
  // Each argument's value; args[k] points at it (cuLaunchKernel's convention).
  std::vector<uint64_t> values(n, 0);
  std::vector<void*> args(n, nullptr);
  std::string bad;
  for (uint32_t k = 0; k < n; ++k) {
    const uint8_t kind = get<uint8_t>();
    switch (kind) {
      case 0: {
        const uint32_t id = get<uint32_t>();
        const uint64_t off = get<uint64_t>();
        unsigned char* p = at(id, off, 0);
        if (!p && bad.empty()) bad = "argument " + std::to_string(k) + " points outside buffer " + std::to_string(id);
        std::memcpy(&values[k], &p, sizeof p);
        break;
      }
      case 1:
        break;
      case 2: {
        const int32_t v = get<int32_t>();
        std::memcpy(&values[k], &v, 4);
        break;
      }
      case 3: {
        const int64_t v = get<int64_t>();
        std::memcpy(&values[k], &v, 8);
        break;
      }
      case 4: {
        const float v = get<float>();
        std::memcpy(&values[k], &v, 4);
        break;
      }
      default:
        std::exit(2);
    }
    args[k] = &values[k];
  }
  if (module >= modules.size()) return fail("no module " + std::to_string(module));
  if (!bad.empty()) return fail(bad);
  if (block == 0 || block > 1024) return fail("block of " + std::to_string(block) + " threads");
  const int rc = modules[module](entry.c_str(), grid, block, args.data());
  if (rc == 1) return fail("no entry `" + entry + "`");
  if (rc != 0) return fail("the launch was refused (code " + std::to_string(rc) + ": a tensor map the driver refuses)");
  count_overlap();
  ok();
}

// One batch of a transfer program: its code (LLVM's host code for the
// program's IR) over the batch's table, with buffer i of the batch at
// bases[i]. The runtime checked every run inside its buffer. On the side
// stream (`side`) it is queued behind the side stream's earlier transfers
// and the reply is its event.
void transfer(bool side) {
  const uint32_t program = get<uint32_t>(), n = get<uint32_t>();
  if (n > (1u << 16)) std::exit(2);
  std::vector<unsigned char*> bases(n, nullptr);
  std::string bad;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t id = get<uint32_t>();
    if (id < buffers.size())
      bases[i] = buffers[id].data;
    else if (bad.empty())
      bad = "no buffer " + std::to_string(id);
  }
  const uint64_t words = get<uint64_t>();
  if (words > (uint64_t{1} << 32)) std::exit(2);
  std::vector<uint64_t> table(words);
  if (!read_exact(table.data(), words * 8)) std::exit(0);
  if (program >= transfers.size()) return fail("no transfer program " + std::to_string(program));
  if (!bad.empty()) return fail(bad);
  if (!side) {
    transfers[program](bases.data(), table.data(), 0, 1);
    count_overlap();
    return ok();
  }
  uint64_t event = 0;
  {
    std::lock_guard<std::mutex> lock(side_mu);
    if (!side_worker) side_worker = new std::thread(side_loop);
    side_queue.push_back(SideJob{transfers[program], std::move(bases), std::move(table)});
    event = ++side_queued;
  }
  side_cv.notify_all();
  ok();
  std::fwrite(&event, 8, 1, stdout);
}

// Blocks until side transfer `event` and every one before it finished.
void wait_side() {
  const uint64_t event = get<uint64_t>();
  uint64_t n = 0;
  {
    std::unique_lock<std::mutex> lock(side_mu);
    if (event > side_queued) {
      lock.unlock();
      return fail("no side transfer " + std::to_string(event));
    }
    if (event > side_wanted) side_wanted = event;
    side_cv.notify_all();
    side_cv.wait(lock, [event] { return side_done >= event; });
    n = overlapped;
  }
  ok();
  std::fwrite(&n, 8, 1, stdout);
}

// Drains and stops the side stream.
void stop_side() {
  {
    std::lock_guard<std::mutex> lock(side_mu);
    side_quit = true;
  }
  side_cv.notify_all();
  if (side_worker && side_worker->joinable()) side_worker->join();
}

// Loads the shared library at the request's path and appends its `symbol`
// to `table`; replies with its index.
template <typename Fn>
void load(std::vector<Fn>& table, const char* symbol) {
  const std::string path = get_string();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  void* f = h ? dlsym(h, symbol) : nullptr;
  if (!f) {
    const char* e = dlerror();
    return fail(std::string("cannot load ") + path + ": " + (e ? e : (std::string("no ") + symbol).c_str()));
  }
  table.push_back(reinterpret_cast<Fn>(f));
  ok();
  const uint32_t id = static_cast<uint32_t>(table.size() - 1);
  std::fwrite(&id, 4, 1, stdout);
}

}  // namespace

int main() {
  for (;;) {
    const uint8_t op = get<uint8_t>();
    switch (op) {
      case 0:
        stop_side();
        return 0;
      case 1: {
        const uint64_t bytes = get<uint64_t>();
        const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
        void* p = rounded ? std::aligned_alloc(4096, rounded) : nullptr;
        if (rounded && !p) {
          fail("cannot allocate " + std::to_string(bytes) + " bytes");
          break;
        }
        if (p) std::memset(p, 0, rounded);
        buffers.push_back(Buffer{static_cast<unsigned char*>(p), bytes});
        ok();
        const uint32_t id = static_cast<uint32_t>(buffers.size() - 1);
        std::fwrite(&id, 4, 1, stdout);
        break;
      }
      case 2: {
        const uint32_t id = get<uint32_t>();
        const uint64_t off = get<uint64_t>(), len = get<uint64_t>();
        unsigned char* p = at(id, off, len);
        std::vector<unsigned char> sink(p ? 0 : len);
        if (!read_exact(p ? p : sink.data(), len)) return 0;
        if (p)
          ok();
        else
          fail("write outside buffer " + std::to_string(id));
        break;
      }
      case 3: {
        const uint32_t id = get<uint32_t>();
        const uint64_t off = get<uint64_t>(), len = get<uint64_t>();
        unsigned char* p = at(id, off, len);
        if (!p) {
          fail("read outside buffer " + std::to_string(id));
          break;
        }
        ok();
        std::fwrite(p, 1, len, stdout);
        break;
      }
      case 4:
        load(modules, "moeforge_emu_launch");
        break;
      case 5:
        launch();
        break;
      case 6:
        transfer(false);
        break;
      case 7:
        load(transfers, "moeforge_xfer");
        break;
      case 8:
        transfer(true);
        break;
      case 9:
        wait_side();
        break;
      case 10: {
        std::lock_guard<std::mutex> lock(side_mu);
        side_lazy = true;
        ok();
        break;
      }
      default:
        stop_side();
        return 2;
    }
    std::fflush(stdout);
  }
}
