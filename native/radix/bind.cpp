// Python binding of the page radix tree (nanobind): token and address input read through the
// buffer protocol where it can be (array('I'), array('Q'), numpy) and checked element by element
// otherwise, holders as any hashable Python object (mapped to small ints here), the clock read
// once per call, node handles that know their tree and their node's generation, and every
// refusal raised as mempool.errors' exceptions.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <time.h>

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bind_common.hpp"
#include "tree.hpp"

using namespace radix_py;
using radix::kRoot;
using radix::NodeId;

namespace {

struct NodeRef {
    std::shared_ptr<Core> core;
    NodeId id;
    uint32_t gen;

    const radix::Node& node() const {
        if (!core->tree.valid(id, gen)) {
            raise(g_invalid_request,
                  "stale tree node: it was evicted, deleted, pruned or reset out of the tree "
                  "since this handle was taken");
        }
        return core->tree.node(id);
    }
};

nb::object make_ref(const std::shared_ptr<Core>& core, NodeId id) {
    if (id == kNone) return nb::none();
    return nb::cast(NodeRef{core, id, core->tree.node(id).gen});
}

nb::object make_array_q(const uint64_t* data, size_t n) {
    nb::object raw = nb::steal(
        PyBytes_FromStringAndSize(reinterpret_cast<const char*>(data), n * sizeof(uint64_t)));
    if (!raw.is_valid()) throw nb::python_error();
    PyObject* arr = PyObject_CallFunctionObjArgs(g_array_type, g_typecode_q, raw.ptr(), nullptr);
    if (!arr) throw nb::python_error();
    return nb::steal(arr);
}

nb::object make_array_q(const std::vector<uint64_t>& v) { return make_array_q(v.data(), v.size()); }
// Addresses (uint64) for `want` slots: an array('Q') is read in place, anything else checked.
class Addresses {
  public:
    Addresses(nb::handle obj, size_t want, size_t pages, size_t stride) {
        PyObject* o = obj.ptr();
        Py_ssize_t len = PyObject_Length(o);
        if (len < 0) {
            PyErr_Clear();
            raise(g_invalid_tokens, "addresses must be a sequence of 64-bit unsigned ints, got " +
                                        type_name(o));
        }
        if (static_cast<size_t>(len) != want) {
            raise(g_invalid_request, "expected " + std::to_string(want) + " addresses for " +
                                         std::to_string(pages) + " whole pages (" +
                                         std::to_string(stride) + " per page), got " +
                                         std::to_string(len));
        }
        if (PyObject_CheckBuffer(o) && !PyBytes_Check(o) && !PyByteArray_Check(o)) {
            Py_buffer view{};
            if (PyObject_GetBuffer(o, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
                throw nb::python_error();
            }
            auto [kind, size] = int_format(view);
            bool ok = kind != 0 && view.ndim <= 1;
            values_.resize(want);
            for (size_t i = 0; ok && i < want; i++) {
                ok = read_int(view, kind, i, values_[i], UINT64_MAX);
            }
            PyBuffer_Release(&view);
            if (!ok) raise(g_invalid_tokens, "addresses must be 64-bit unsigned ints");
            return;
        }
        nb::object seq = nb::steal(PySequence_Fast(o, "not a sequence"));
        if (!seq.is_valid()) throw nb::python_error();
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        values_.resize(want);
        for (size_t i = 0; i < want; i++) {
            PyObject* item = items[i];
            uint64_t small;
            if (small_int(item, small)) {
                values_[i] = small;
                continue;
            }
            if (!PyLong_Check(item)) {
                raise(g_invalid_tokens,
                      "addresses must be 64-bit unsigned ints: got " + type_name(item));
            }
            unsigned long long v = PyLong_AsUnsignedLongLong(item);
            if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
                PyErr_Clear();
                raise(g_invalid_tokens, std::string("addresses must be 64-bit unsigned ints: ") +
                                            nb::repr(nb::handle(item)).c_str() +
                                            " is out of range");
            }
            values_[i] = v;
        }
    }
    const uint64_t* data() const { return values_.data(); }
    std::vector<uint64_t> take() { return std::move(values_); }

  private:
    std::vector<uint64_t> values_;
};

// ------------------------------------------------------------------ results

struct Match {
    nb::object num_tokens, value, node, holder_tokens;
};

struct InsertResult {
    nb::object existing_tokens, new_tokens, duplicates, node;
};

nb::dict holder_dict(Core& core, const std::vector<std::pair<HolderId, int64_t>>& found) {
    nb::dict out;
    for (const auto& [id, tokens] : found) out[core.holder_obj(id)] = nb::int_(tokens);
    return out;
}

// ------------------------------------------------------------------ the tree object

int64_t checked_int(nb::handle obj, const char* what, int64_t lo, int64_t hi) {
    if (PyBool_Check(obj.ptr()) || !PyLong_Check(obj.ptr())) {
        raise(g_invalid_request, std::string(what) + " must be an int, got " +
                                     nb::repr(obj).c_str());
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
    if (overflow || v < lo || v > hi) {
        raise(g_invalid_request, std::string(what) + " must lie in " + std::to_string(lo) +
                                     ".." + std::to_string(hi) + ", got " +
                                     nb::repr(obj).c_str());
    }
    return v;
}

struct PyTree {
    std::shared_ptr<Core> core;

    PyTree(nb::handle page_size, nb::handle slots_per_page, nb::object clock) {
        if (PyBool_Check(page_size.ptr()) || !PyLong_Check(page_size.ptr())) {
            raise(g_invalid_request, std::string("page_size must be a positive int, got ") +
                                         nb::repr(page_size).c_str());
        }
        int64_t ps = checked_int(page_size, "page_size", 1, 1 << 20);
        int64_t stride = checked_int(slots_per_page, "slots_per_page", 0, 1 << 20);
        if (clock.is_none()) clock = nb::borrow(g_monotonic);
        if (!PyCallable_Check(clock.ptr())) raise(PyExc_TypeError, "clock must be callable");
        core = std::make_shared<Core>(static_cast<uint32_t>(ps), static_cast<uint32_t>(stride),
                                      std::move(clock));
    }

    radix::Tree& tree() { return core->tree; }

    NodeId own(const NodeRef& ref) {
        if (ref.core.get() != core.get()) {
            raise(g_invalid_request, "this node belongs to another tree");
        }
        ref.node();  // raises if stale
        return ref.id;
    }

    nb::object match(nb::handle tokens, nb::handle ttl, bool split) {
        Tokens t(tokens, core->scratch, tree().page_size());
        double now = core->now();
        double cutoff = 0;
        if (!ttl.is_none()) cutoff = now - nb::cast<double>(ttl);
        radix::MatchOut m =
            tree().match(t.data(), t.whole(), now, ttl.is_none() ? nullptr : &cutoff, split);
        return nb::cast(Match{nb::int_(m.num_tokens), make_array_q(m.value),
                              make_ref(core, m.node), holder_dict(*core, m.holder_tokens)});
    }

    nb::dict holders(nb::handle tokens, nb::handle ttl) {
        Tokens t(tokens, core->scratch, tree().page_size());
        double now = core->now();
        double cutoff = -std::numeric_limits<double>::infinity();
        if (!ttl.is_none()) cutoff = now - nb::cast<double>(ttl);
        std::vector<std::pair<HolderId, int64_t>> found;
        tree().holders(t.data(), t.whole(), now, cutoff, found);
        return holder_dict(*core, found);
    }

    nb::object insert(nb::handle tokens, nb::handle value, nb::handle holder, nb::handle tier) {
        Tokens t(tokens, core->scratch, tree().page_size());
        size_t pages = t.whole() / tree().page_size();
        size_t stride = tree().stride();
        std::unique_ptr<Addresses> addrs;
        if (stride == 0) {
            if (!value.is_none()) {
                raise(g_invalid_request, "this tree stores no values (slots_per_page=0)");
            }
        } else {
            if (value.is_none()) {
                raise(g_invalid_request, "insert needs one address list entry per page slot");
            }
            addrs = std::make_unique<Addresses>(value, pages * stride, pages, stride);
        }
        int32_t tier_v = static_cast<int32_t>(checked_int(tier, "tier", -(1 << 30), 1 << 30));
        double now = core->now();
        HolderId hid = holder.is_none() ? kNone : core->holder_id(holder);
        radix::InsertOut r = tree().insert(t.data(), t.whole(), addrs ? addrs->data() : nullptr,
                                           hid, tier_v, now);
        core->settle(hid);
        nb::list dups;
        for (uint64_t d : r.duplicates) dups.append(nb::int_(d));
        return nb::cast(InsertResult{nb::int_(r.existing_tokens), nb::int_(r.new_tokens), dups,
                                     make_ref(core, r.node)});
    }

    nb::object erase(nb::handle tokens) {
        Tokens t(tokens, core->scratch, tree().page_size());
        std::vector<uint64_t> removed = tree().erase(t.data(), t.whole());
        core->settle();
        return make_array_q(removed);
    }

    nb::tuple evict(nb::handle num_pages, nb::handle tier) {
        int64_t n = checked_int(num_pages, "num_pages", INT64_MIN, INT64_MAX);
        int32_t tier_v = static_cast<int32_t>(checked_int(tier, "tier", -(1 << 30), 1 << 30));
        radix::Removed r = tree().evict(n, tier_v);
        core->settle();
        return nb::make_tuple(nb::int_(r.pages), make_array_q(r.values));
    }

    void lock(const NodeRef& node) { tree().lock(own(node)); }
    void unlock(const NodeRef& node) { tree().unlock(own(node)); }

    int64_t remove_holder(nb::handle holder, nb::handle tokens, nb::handle keep_tokens) {
        int64_t pruned;
        if (tokens.is_none()) {
            HolderId hid = core->find_holder(holder);
            pruned = hid == kNone ? 0 : tree().remove_holder_everywhere(hid);
        } else {
            Tokens t(tokens, core->scratch, tree().page_size());
            int64_t keep = checked_int(keep_tokens, "keep_tokens", INT64_MIN, INT64_MAX);
            pruned = tree().remove_holder_on_path(core->find_holder(holder), t.data(),
                                                  t.whole(), keep);
        }
        core->settle();
        return pruned;
    }

    int64_t expire(double older_than) {
        int64_t pruned = tree().expire(older_than);
        core->settle();
        return pruned;
    }

    nb::object lru_leaf(nb::handle tier) {
        int32_t tier_v = static_cast<int32_t>(checked_int(tier, "tier", -(1 << 30), 1 << 30));
        return make_ref(core, tree().lru_leaf(tier_v));
    }

    void set_tier(const NodeRef& node, nb::handle tier) {
        int32_t tier_v = static_cast<int32_t>(checked_int(tier, "tier", -(1 << 30), 1 << 30));
        tree().set_tier(own(node), tier_v);
    }

    nb::object split(const NodeRef& node, nb::handle pages) {
        int64_t p = checked_int(pages, "pages", INT64_MIN, INT64_MAX);
        return make_ref(core, tree().split(own(node), p));
    }

    nb::list node_list(const std::vector<NodeId>& ids) {
        nb::list out;
        for (NodeId id : ids) out.append(make_ref(core, id));
        return out;
    }

    nb::list lru_unlocked(nb::handle limit) {
        size_t lim = limit.is_none()
                         ? SIZE_MAX
                         : static_cast<size_t>(checked_int(limit, "limit", 0, INT64_MAX));
        return node_list(tree().lru_unlocked(lim));
    }

    int64_t repoint(nb::handle moved, nb::handle nodes) {
        std::unordered_map<uint64_t, uint64_t> map;
        nb::object items = nb::steal(PyMapping_Items(moved.ptr()));
        if (!items.is_valid()) throw nb::python_error();
        for (nb::handle item : items) {
            auto pair = nb::borrow<nb::tuple>(item);
            map[nb::cast<uint64_t>(pair[0])] = nb::cast<uint64_t>(pair[1]);
        }
        if (nodes.is_none()) return tree().repoint(map, nullptr);
        std::vector<NodeId> ids;
        for (nb::handle n : nb::iter(nodes)) ids.push_back(own(nb::cast<const NodeRef&>(n)));
        return tree().repoint(map, &ids);
    }

    nb::object reset() {
        std::vector<uint64_t> removed = tree().reset();
        core->settle();
        return make_array_q(removed);
    }
};

}  // namespace

std::shared_ptr<Core> radix_py::tree_core(nb::handle tree) {
    if (!nb::isinstance<PyTree>(tree)) {
        raise(PyExc_TypeError, "expected a mempool.radix.RadixTree, got " + type_name(tree.ptr()));
    }
    return nb::cast<PyTree&>(tree).core;
}

NB_MODULE(_radix, m) {
    m.doc() = "The page radix tree in C++ (mempool.radix re-exports it).";
    // A process that exits with trees and workers still referenced (the router's globals)
    // is not leaking them; nanobind would list each one on stderr at exit.
    nb::set_leak_warnings(false);
    nb::module_ errors = nb::module_::import_("mempool.errors");
    g_invalid_request = errors.attr("InvalidRequest").inc_ref().ptr();
    g_invalid_tokens = errors.attr("InvalidTokens").inc_ref().ptr();
    g_block_in_use = errors.attr("BlockInUse").inc_ref().ptr();
    g_array_type = nb::module_::import_("array").attr("array").inc_ref().ptr();
    g_typecode_q = nb::str("Q").inc_ref().ptr();
    g_monotonic = nb::module_::import_("time").attr("monotonic").inc_ref().ptr();
    m.attr("TOKEN_BYTES") = 4;

    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const radix::TreeError& e) {
            PyObject* cls = e.kind == radix::ErrorKind::BlockInUse ? g_block_in_use
                                                                   : g_invalid_request;
            PyErr_SetString(cls, e.what());
        } catch (const std::logic_error& e) {
            PyErr_SetString(PyExc_AssertionError, e.what());
        }
    });

    nb::class_<Match>(m, "Match", "Result of `match`: the longest cached prefix and, per holder, "
                                  "how much of it each holds.")
        .def(nb::init<>())
        .def("__init__",
             [](Match* self, nb::object num_tokens, nb::object value, nb::object node,
                nb::object holder_tokens) {
                 new (self) Match{num_tokens, value, node, holder_tokens};
             },
             nb::arg("num_tokens"), nb::arg("value"), nb::arg("node"), nb::arg("holder_tokens"))
        .def_rw("num_tokens", &Match::num_tokens)
        .def_rw("value", &Match::value)
        .def_rw("node", &Match::node)
        .def_rw("holder_tokens", &Match::holder_tokens);

    nb::class_<InsertResult>(m, "InsertResult",
                             "`existing_tokens` were cached already; `duplicates` are given "
                             "addresses not adopted.")
        .def("__init__",
             [](InsertResult* self, nb::object existing, nb::object fresh, nb::object dups,
                nb::object node) { new (self) InsertResult{existing, fresh, dups, node}; },
             nb::arg("existing_tokens"), nb::arg("new_tokens"), nb::arg("duplicates"),
             nb::arg("node"))
        .def_rw("existing_tokens", &InsertResult::existing_tokens)
        .def_rw("new_tokens", &InsertResult::new_tokens)
        .def_rw("duplicates", &InsertResult::duplicates)
        .def_rw("node", &InsertResult::node);

    nb::class_<NodeRef>(m, "TreeNode",
                        "A handle on one edge of a tree: a run of whole pages. It raises once "
                        "its node left the tree (evicted, deleted, pruned, reset).")
        .def_prop_ro("key",
                     [](const NodeRef& r) {
                         const auto& k = r.node().key;
                         return nb::bytes(reinterpret_cast<const char*>(k.data()), k.size() * 4);
                     })
        .def_prop_rw(
            "value",
            [](const NodeRef& r) -> nb::object {
                const auto& n = r.node();
                if (r.core->tree.stride() == 0 || n.parent == kNone) return nb::none();
                return make_array_q(n.value);
            },
            [](NodeRef& r, nb::handle value) {
                const auto& n = r.node();
                size_t want = n.key.size() / r.core->tree.page_size() * r.core->tree.stride();
                Addresses a(value, want, n.key.size() / r.core->tree.page_size(),
                            r.core->tree.stride());
                r.core->tree.set_value(r.id, a.take());
            })
        .def_prop_ro("parent",
                     [](const NodeRef& r) { return make_ref(r.core, r.node().parent); })
        .def_prop_ro("children",
                     [](const NodeRef& r) {
                         const auto& n = r.node();
                         size_t pb = r.core->tree.page_size() * 4;
                         nb::dict out;
                         for (NodeId c : n.children) {
                             const auto& k = r.core->tree.node(c).key;
                             out[nb::bytes(reinterpret_cast<const char*>(k.data()), pb)] =
                                 make_ref(r.core, c);
                         }
                         return out;
                     })
        .def_prop_ro("holders",
                     [](const NodeRef& r) -> nb::object {
                         const auto& n = r.node();
                         if (n.holders.empty()) return nb::none();
                         nb::dict out;
                         for (const auto& h : n.holders) {
                             out[r.core->holder_obj(h.holder)] = nb::float_(h.seen);
                         }
                         return out;
                     })
        .def_prop_ro("lock_ref", [](const NodeRef& r) { return r.node().lock_ref; })
        .def_prop_ro("last_access", [](const NodeRef& r) { return r.node().last_access; })
        .def_prop_ro("attached", [](const NodeRef& r) { return r.node().attached; })
        .def_prop_ro("tier", [](const NodeRef& r) { return r.node().tier; })
        .def_prop_ro("lru_stamp", [](const NodeRef& r) { return r.node().lru_stamp; })
        .def_prop_ro("valid", [](const NodeRef& r) { return r.core->tree.valid(r.id, r.gen); })
        .def("__eq__",
             [](const NodeRef& a, nb::handle b) -> nb::object {
                 if (!nb::isinstance<NodeRef>(b)) return nb::steal(Py_NewRef(Py_NotImplemented));
                 const NodeRef& o = nb::cast<const NodeRef&>(b);
                 return nb::bool_(a.core == o.core && a.id == o.id && a.gen == o.gen);
             })
        .def("__ne__",
             [](const NodeRef& a, nb::handle b) -> nb::object {
                 if (!nb::isinstance<NodeRef>(b)) return nb::steal(Py_NewRef(Py_NotImplemented));
                 const NodeRef& o = nb::cast<const NodeRef&>(b);
                 return nb::bool_(!(a.core == o.core && a.id == o.id && a.gen == o.gen));
             })
        .def("__hash__",
             [](const NodeRef& r) {
                 return static_cast<Py_hash_t>(
                     (reinterpret_cast<uintptr_t>(r.core.get()) >> 4) * 1000003u ^
                     (static_cast<uint64_t>(r.id) << 20) ^ r.gen);
             })
        .def("__repr__", [](const NodeRef& r) {
            if (!r.core->tree.valid(r.id, r.gen)) return std::string("<TreeNode stale>");
            const auto& n = r.core->tree.node(r.id);
            return "<TreeNode " + std::to_string(n.key.size() / r.core->tree.page_size()) +
                   " pages lock=" + std::to_string(n.lock_ref) +
                   (n.attached ? "" : " detached") + ">";
        });

    nb::class_<PyTree>(m, "RadixTree",
                       "Page radix tree. `slots_per_page` addresses are stored per page (0: a "
                       "holders-only tree); `clock` must never go backwards.")
        .def(nb::init<nb::handle, nb::handle, nb::object>(), nb::arg("page_size") = 16,
             nb::arg("slots_per_page") = 1, nb::arg("clock") = nb::none())
        .def_prop_ro("page_size", [](PyTree& t) { return t.tree().page_size(); })
        .def_prop_ro("page_bytes", [](PyTree& t) { return t.tree().page_size() * 4; })
        .def_prop_ro("stride", [](PyTree& t) { return t.tree().stride(); })
        .def_prop_ro("clock", [](PyTree& t) { return t.core->clock; })
        .def_prop_ro("root", [](PyTree& t) { return make_ref(t.core, kRoot); })
        .def_prop_ro("evictable_pages", [](PyTree& t) { return t.tree().evictable_pages(); })
        .def_prop_ro("protected_pages", [](PyTree& t) { return t.tree().protected_pages(); })
        .def_prop_ro("num_pages",
                     [](PyTree& t) {
                         return t.tree().evictable_pages() + t.tree().protected_pages();
                     })
        .def("match", &PyTree::match, nb::arg("tokens"), nb::arg("ttl") = nb::none(),
             nb::arg("split") = false)
        .def("holders", &PyTree::holders, nb::arg("tokens"), nb::arg("ttl") = nb::none())
        .def("insert", &PyTree::insert, nb::arg("tokens"), nb::arg("value") = nb::none(),
             nb::arg("holder") = nb::none(), nb::arg("tier") = 0)
        .def("delete", &PyTree::erase, nb::arg("tokens"))
        .def("evict", &PyTree::evict, nb::arg("num_pages"), nb::arg("tier") = 0)
        .def("lock", &PyTree::lock, nb::arg("node"))
        .def("unlock", &PyTree::unlock, nb::arg("node"))
        .def("remove_holder", &PyTree::remove_holder, nb::arg("holder"),
             nb::arg("tokens") = nb::none(), nb::arg("keep_tokens") = 0)
        .def("expire", &PyTree::expire, nb::arg("older_than"))
        .def("lru_leaf", &PyTree::lru_leaf, nb::arg("tier") = 0)
        .def("set_tier", &PyTree::set_tier, nb::arg("node"), nb::arg("tier"))
        .def("split", &PyTree::split, nb::arg("node"), nb::arg("pages"))
        .def("lru_unlocked", &PyTree::lru_unlocked, nb::arg("limit") = nb::none())
        .def("repoint", &PyTree::repoint, nb::arg("moved"), nb::arg("nodes") = nb::none())
        .def("reset", &PyTree::reset)
        .def("nodes", [](PyTree& t) { return t.node_list(t.tree().nodes()); })
        .def("_check", [](PyTree& t) { t.tree().check(); })
        .def("_heap_size", [](PyTree& t, int32_t tier) { return t.tree().heap_size(tier); },
             nb::arg("tier") = 0)
        .def_prop_ro("_expiry_size", [](PyTree& t) { return t.tree().expiry_size(); })
        .def_prop_ro("_queued_leaves", [](PyTree& t) { return t.tree().queued_leaves(); })
        .def_prop_ro("_holder_entries", [](PyTree& t) { return t.tree().holder_entries(); })
        .def_prop_ro("_full_walks", [](PyTree& t) { return t.tree().full_walks(); })
        .def_prop_ro("_live_nodes", [](PyTree& t) { return t.tree().live_nodes(); })
        .def_prop_ro("_known_holders",
                     [](PyTree& t) { return PyDict_Size(t.core->holder_ids.ptr()); })
        .def_prop_ro("_memory_bytes", [](PyTree& t) { return t.tree().memory_bytes(); });

    bind_decide(m);
}
