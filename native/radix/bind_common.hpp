// What the tree binding (bind.cpp) and the decision binding (bind_decide.cpp) share: the
// error classes and clock looked up at import, a tree's Python-side state (`Core`: holder
// objects as small ints, the clock) and token input read in place or checked (`Tokens`).
#pragma once

#include <nanobind/nanobind.h>

#include <time.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tree.hpp"

namespace radix_py {

namespace nb = nanobind;
using radix::HolderId;
using radix::kNone;

// mempool.errors' classes and array.array, looked up once (owned for the process's life).
inline PyObject* g_invalid_request = nullptr;
inline PyObject* g_invalid_tokens = nullptr;
inline PyObject* g_block_in_use = nullptr;
inline PyObject* g_array_type = nullptr;
inline PyObject* g_typecode_q = nullptr;
inline PyObject* g_monotonic = nullptr;

[[noreturn]] inline void raise(PyObject* cls, const std::string& msg) {
    PyErr_SetString(cls, msg.c_str());
    throw nb::python_error();
}

inline std::string type_name(PyObject* obj) { return Py_TYPE(obj)->tp_name; }

// ------------------------------------------------------------------ the shared state

struct Core {
    radix::Tree tree;
    nb::object clock;
    bool monotonic;
    nb::dict holder_ids;                // holder object -> its small int
    std::vector<nb::object> holder_objs;  // small int -> holder object (None: free)
    std::vector<HolderId> free_ids;
    std::vector<uint32_t> scratch;  // tokens converted from a list

    Core(uint32_t page_size, uint32_t stride, nb::object clk)
        : tree(page_size, stride), clock(std::move(clk)), monotonic(clock.ptr() == g_monotonic) {}

    double now() {
        if (monotonic) {  // time.monotonic itself, without the call
            timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            return static_cast<double>(ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
        }
        nb::object t = clock();
        double v = PyFloat_AsDouble(t.ptr());
        if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
        return v;
    }

    HolderId find_holder(nb::handle holder) {
        PyObject* found = PyDict_GetItemWithError(holder_ids.ptr(), holder.ptr());
        if (!found) {
            if (PyErr_Occurred()) throw nb::python_error();  // unhashable
            return kNone;
        }
        return static_cast<HolderId>(PyLong_AsUnsignedLong(found));
    }

    HolderId holder_id(nb::handle holder) {
        HolderId id = find_holder(holder);
        if (id != kNone) return id;
        if (!free_ids.empty()) {
            id = free_ids.back();
            free_ids.pop_back();
            holder_objs[id] = nb::borrow(holder);
        } else {
            id = static_cast<HolderId>(holder_objs.size());
            holder_objs.push_back(nb::borrow(holder));
        }
        nb::object key = nb::int_(id);
        if (PyDict_SetItem(holder_ids.ptr(), holder.ptr(), key.ptr()) != 0) {
            throw nb::python_error();
        }
        return id;
    }

    // Forget holders that no node holds any more (and one registered for a call that
    // recorded nothing), so holder objects do not accumulate.
    void settle(HolderId maybe_unused = kNone) {
        auto& released = tree.released_holders();
        if (maybe_unused != kNone) released.push_back(maybe_unused);
        for (HolderId id : released) {
            if (id >= holder_objs.size() || !holder_objs[id].is_valid() ||
                tree.holds_any(id)) {
                continue;
            }
            nb::object obj = std::move(holder_objs[id]);
            holder_objs[id] = nb::object();
            if (PyDict_DelItem(holder_ids.ptr(), obj.ptr()) != 0) PyErr_Clear();
            free_ids.push_back(id);
        }
        released.clear();
    }

    nb::object holder_obj(HolderId id) const { return holder_objs.at(id); }
};



// ------------------------------------------------------------------ input checks

// A buffer's item format as (kind, size): 'u' unsigned int, 'i' signed int, 0 otherwise.
inline std::pair<char, size_t> int_format(const Py_buffer& view) {
    const char* f = view.format ? view.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;  // native or little-endian (x86, arm64)
    if (f[0] == 0 || f[1] != 0) return {0, 0};
    switch (*f) {
        case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
            return {'u', static_cast<size_t>(view.itemsize)};
        case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
            return {'i', static_cast<size_t>(view.itemsize)};
        default:
            return {0, 0};
    }
}

template <typename T>
bool read_int(const Py_buffer& view, char kind, size_t i, T& out, uint64_t max) {
    const char* p = static_cast<const char*>(view.buf) + i * view.itemsize;
    if (kind == 'u') {
        uint64_t v = 0;
        switch (view.itemsize) {
            case 1: v = *reinterpret_cast<const uint8_t*>(p); break;
            case 2: { uint16_t x; std::memcpy(&x, p, 2); v = x; break; }
            case 4: { uint32_t x; std::memcpy(&x, p, 4); v = x; break; }
            default: { uint64_t x; std::memcpy(&x, p, 8); v = x; break; }
        }
        if (v > max) return false;
        out = static_cast<T>(v);
        return true;
    }
    int64_t v = 0;
    switch (view.itemsize) {
        case 1: v = *reinterpret_cast<const int8_t*>(p); break;
        case 2: { int16_t x; std::memcpy(&x, p, 2); v = x; break; }
        case 4: { int32_t x; std::memcpy(&x, p, 4); v = x; break; }
        default: { int64_t x; std::memcpy(&x, p, 8); v = x; break; }
    }
    if (v < 0 || static_cast<uint64_t>(v) > max) return false;
    out = static_cast<T>(v);
    return true;
}

// A small non-negative int read straight from its object (the common case: token ids are
// below 2**30), or false to take the checked path.
inline bool small_int(PyObject* item, uint64_t& out) {
    if (!PyLong_CheckExact(item)) return false;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) return false;
    Py_ssize_t v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item));
    if (v < 0) return false;
    out = static_cast<uint64_t>(v);
    return true;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 0) {
        out = 0;
        return true;
    }
    if (size != 1) return false;
    out = reinterpret_cast<PyLongObject*>(item)->ob_digit[0];
    return true;
#endif
}

// Token ids as uint32s: read in place from an array('I') (or any 4-byte unsigned buffer),
// converted with bounds checks from other int buffers, lists, tuples and iterables.
class Tokens {
  public:
    Tokens(nb::handle obj, std::vector<uint32_t>& scratch, uint32_t page_size) {
        PyObject* o = obj.ptr();
        if (PyUnicode_Check(o) || PyBytes_Check(o) || PyByteArray_Check(o) ||
            PyMemoryView_Check(o)) {
            raise(g_invalid_tokens,
                  "tokens must be a sequence of int token ids, got " + type_name(o));
        }
        if (PyObject_CheckBuffer(o)) {
            if (PyObject_GetBuffer(o, &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
                throw nb::python_error();
            }
            held_ = true;
            auto [kind, size] = int_format(view_);
            if (view_.ndim > 1 || kind == 0) {
                raise(g_invalid_tokens, "tokens must be a sequence of int token ids, got a " +
                                            type_name(o) + " of format '" +
                                            (view_.format ? view_.format : "B") + "'");
            }
            n_ = static_cast<size_t>(view_.len / view_.itemsize);
            if (kind == 'u' && size == 4) {
                data_ = static_cast<const uint32_t*>(view_.buf);
            } else {
                scratch.resize(n_);
                for (size_t i = 0; i < n_; i++) {
                    if (!read_int(view_, kind, i, scratch[i], UINT32_MAX)) {
                        raise(g_invalid_request, "token ids must lie in 0..4294967295");
                    }
                }
                data_ = scratch.data();
            }
        } else {
            nb::object seq = nb::steal(PySequence_Fast(o, "not iterable"));
            if (!seq.is_valid()) {
                PyErr_Clear();
                raise(g_invalid_tokens,
                      "tokens must be a sequence of int token ids, got " + type_name(o));
            }
            n_ = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
            PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
            scratch.resize(n_);
            for (size_t i = 0; i < n_; i++) {
                PyObject* item = items[i];
                uint64_t small;
                if (small_int(item, small)) {  // < 2**30 (3.11) or compact (3.12+)
                    if (small > UINT32_MAX) {
                        raise(g_invalid_request, "token ids must lie in 0..4294967295");
                    }
                    scratch[i] = static_cast<uint32_t>(small);
                    continue;
                }
                if (!PyLong_Check(item)) {
                    raise(g_invalid_tokens, "tokens must be a sequence of int token ids: got " +
                                                type_name(item));
                }
                int overflow = 0;
                long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
                if (overflow || v < 0 || v > UINT32_MAX) {
                    raise(g_invalid_request, "token ids must lie in 0..4294967295");
                }
                scratch[i] = static_cast<uint32_t>(v);
            }
            data_ = scratch.data();
        }
        if (n_ == 0) raise(g_invalid_request, "tokens must not be empty");
        whole_ = n_ - n_ % page_size;  // a partial last page is never cached nor matched
    }
    ~Tokens() {
        if (held_) PyBuffer_Release(&view_);
    }
    Tokens(const Tokens&) = delete;
    Tokens& operator=(const Tokens&) = delete;

    const uint32_t* data() const { return data_; }
    size_t size() const { return n_; }
    size_t whole() const { return whole_; }

  private:
    Py_buffer view_{};
    bool held_ = false;
    const uint32_t* data_ = nullptr;
    size_t n_ = 0, whole_ = 0;
};


// The shared state of a mempool.radix.RadixTree (TypeError for anything else).
std::shared_ptr<Core> tree_core(nb::handle tree);

// The decision's classes and functions (bind_decide.cpp), added to the module.
void bind_decide(nb::module_& m);

}  // namespace radix_py
