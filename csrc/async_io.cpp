// Asynchronous file IO for ZeRO-Cache's NVMe tier over Linux native AIO (io_setup / io_submit /
// io_getevents), called through the kernel ABI in <linux/aio_abi.h>.
//
// Why the raw syscalls rather than libaio: libaio is a thin wrapper over these same five calls,
// but its header and shared library are often missing (on the GPU machines measured and on CI),
// while the kernel headers are always there. Going to the ABI directly means this extension
// builds wherever a C++ compiler does, with the same queueing behaviour as libaio.
//
// Model: a request is one contiguous (buffer, file offset, length) transfer, split into
// block_size pieces; at most queue_depth pieces are in the kernel at once (the rest wait in a
// queue and go in as completions are reaped). With O_DIRECT files the kernel DMA-s straight into
// the (pinned, 4 KiB-aligned) bounce buffer and io_submit does not block. A request's error is
// the first failed piece's errno, or EIO for a short transfer (a full disk shows up as ENOSPC);
// poll and wait return it and the Python side raises OSError. Every call releases the GIL, so the
// training thread keeps running while the worker waits here.

#include <pybind11/pybind11.h>

#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

int io_setup(unsigned nr, aio_context_t* ctx) { return static_cast<int>(syscall(SYS_io_setup, nr, ctx)); }
int io_destroy(aio_context_t ctx) { return static_cast<int>(syscall(SYS_io_destroy, ctx)); }
int io_submit(aio_context_t ctx, long nr, iocb** iocbs) { return static_cast<int>(syscall(SYS_io_submit, ctx, nr, iocbs)); }
int io_getevents(aio_context_t ctx, long min_nr, long nr, io_event* events, timespec* timeout) {
  return static_cast<int>(syscall(SYS_io_getevents, ctx, min_nr, nr, events, timeout));
}

// The caller keeps each request's buffer alive until poll or wait has reported it complete.
struct Request {
  int64_t remaining = 0;  // pieces not yet completed
  int error = 0;          // first errno seen, 0 if none
};

struct Piece {
  iocb cb;
  int64_t request;
};

class AioContext {
 public:
  AioContext(int64_t queue_depth, int64_t block_size, bool single_submit)
      : depth_(queue_depth), block_(block_size), single_submit_(single_submit) {
    if (queue_depth < 1 || block_size < 4096 || block_size % 4096 != 0) {
      throw std::invalid_argument("async_io: queue_depth must be >= 1 and block_size a positive multiple of 4096");
    }
    if (io_setup(static_cast<unsigned>(depth_), &ctx_) != 0) {
      throw std::runtime_error(std::string("io_setup failed: ") + std::strerror(errno));
    }
    pieces_.resize(depth_);
    for (int64_t i = 0; i < depth_; ++i) free_pieces_.push_back(i);
  }

  ~AioContext() {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      while (in_kernel_ > 0) collect_locked(1);  // never free buffers the kernel may still touch
    } catch (const std::exception&) {
      // io_getevents failed: nothing more can be learnt about those pieces; destroy the context anyway.
    }
    io_destroy(ctx_);
  }

  // Starts moving nbytes between host memory at address and the file at offset; returns the request id.
  int64_t submit(int64_t fd, uintptr_t address, int64_t nbytes, int64_t offset, bool write) {
    auto* base = reinterpret_cast<char*>(address);
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t id = next_id_++;
    Request& request = requests_[id];
    for (int64_t done = 0; done < nbytes; done += block_) {
      const int64_t length = std::min(block_, nbytes - done);
      waiting_.push_back({static_cast<int>(fd), base + done, length, offset + done, write, id});
      ++request.remaining;
    }
    pump_locked();
    return id;
  }

  // -1 while the request runs; once it has completed, its errno (0 = success), and it is forgotten.
  int poll(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_kernel_ > 0) reap_locked(0);
    return finish_if_done_locked(id);
  }

  // Blocks until the request completes; returns its errno (0 = success).
  int wait(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    int status;
    while ((status = finish_if_done_locked(id)) < 0) {
      if (in_kernel_ == 0) pump_locked();
      if (in_kernel_ == 0) throw std::logic_error("async_io: a request is pending with nothing in the kernel");
      reap_locked(1);
    }
    return status;
  }

  int64_t in_flight() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(requests_.size());
  }

 private:
  struct Waiting {
    int fd;
    char* address;
    int64_t length, offset;
    bool write;
    int64_t request;
  };

  int finish_if_done_locked(int64_t id) {
    auto found = requests_.find(id);
    if (found == requests_.end()) throw std::out_of_range("async_io: unknown or already completed request");
    if (found->second.remaining > 0) return -1;
    const int error = found->second.error;
    requests_.erase(found);
    return error;
  }

  void pump_locked() {
    std::vector<iocb*> batch;
    while (!waiting_.empty() && !free_pieces_.empty()) {
      const Waiting next = waiting_.front();
      waiting_.pop_front();
      const int64_t slot = free_pieces_.back();
      free_pieces_.pop_back();
      Piece& piece = pieces_[slot];
      std::memset(&piece.cb, 0, sizeof(piece.cb));
      piece.request = next.request;
      piece.cb.aio_data = static_cast<uint64_t>(slot);
      piece.cb.aio_lio_opcode = next.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      piece.cb.aio_fildes = static_cast<uint32_t>(next.fd);
      piece.cb.aio_buf = reinterpret_cast<uint64_t>(next.address);
      piece.cb.aio_nbytes = static_cast<uint64_t>(next.length);
      piece.cb.aio_offset = next.offset;
      batch.push_back(&piece.cb);
      if (single_submit_) submit_batch_locked(batch);
    }
    submit_batch_locked(batch);
  }

  void submit_batch_locked(std::vector<iocb*>& batch) {
    size_t sent = 0;
    while (sent < batch.size()) {
      const int rc = io_submit(ctx_, static_cast<long>(batch.size() - sent), batch.data() + sent);
      if (rc < 0) {
        const bool retry = errno == EINTR || (errno == EAGAIN && in_kernel_ > 0);
        if (retry) {  // wait for a completion to free kernel resources (no pumping here: no nesting)
          if (errno == EAGAIN) collect_locked(1);
          continue;
        }
        const int error = errno;  // fail the pieces that did not go in (EAGAIN with nothing in flight too)
        for (size_t i = sent; i < batch.size(); ++i) complete_locked(static_cast<int64_t>(batch[i]->aio_data), -error);
        break;
      }
      in_kernel_ += rc;
      sent += static_cast<size_t>(rc);
    }
    batch.clear();
  }

  // Completes at least min_nr pieces, then submits waiting ones into the freed queue slots.
  void reap_locked(long min_nr) {
    collect_locked(min_nr);
    pump_locked();
  }

  void collect_locked(long min_nr) {
    std::vector<io_event> events(static_cast<size_t>(depth_));
    const int got = io_getevents(ctx_, min_nr, depth_, events.data(), nullptr);
    if (got < 0) {
      if (errno == EINTR) return;
      throw std::runtime_error(std::string("io_getevents failed: ") + std::strerror(errno));
    }
    for (int i = 0; i < got; ++i) {
      const auto slot = static_cast<int64_t>(events[i].data);
      --in_kernel_;
      complete_locked(slot, events[i].res);
    }
  }

  void complete_locked(int64_t slot, int64_t result) {
    Piece& piece = pieces_[slot];
    Request& request = requests_.at(piece.request);
    if (request.error == 0) {
      if (result < 0) request.error = static_cast<int>(-result);
      else if (static_cast<uint64_t>(result) != piece.cb.aio_nbytes) request.error = EIO;  // short transfer
    }
    --request.remaining;
    free_pieces_.push_back(slot);
  }

  aio_context_t ctx_ = 0;
  const int64_t depth_, block_;
  const bool single_submit_;
  std::mutex mutex_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> free_pieces_;
  std::deque<Waiting> waiting_;
  std::unordered_map<int64_t, Request> requests_;
  int64_t next_id_ = 0;
  int64_t in_kernel_ = 0;
};

}  // namespace

// Plain pybind11 (no torch headers): addresses come in as integers, which keeps the build to seconds.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<AioContext>(m, "AioContext")
      .def(py::init<int64_t, int64_t, bool>(), py::arg("queue_depth"), py::arg("block_size"), py::arg("single_submit"))
      .def("submit", &AioContext::submit, py::call_guard<py::gil_scoped_release>(), py::arg("fd"), py::arg("address"),
           py::arg("nbytes"), py::arg("offset"), py::arg("write"))
      .def("poll", &AioContext::poll, py::call_guard<py::gil_scoped_release>())
      .def("wait", &AioContext::wait, py::call_guard<py::gil_scoped_release>())
      .def("in_flight", &AioContext::in_flight);
}
