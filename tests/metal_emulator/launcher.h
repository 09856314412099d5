// Runs a kernel compiled from MSL as C++ (see metal_stdlib) over a Metal-style grid on the CPU.
//
// Grid semantics follow torch.mps's `lib.kernel(..., threads=, group_size=)`, i.e. Metal's dispatchThreads:
// `grid` is the total thread count per dimension, `group` the threadgroup size; edge threadgroups are partial
// (threads_per_threadgroup says how many lanes they have). Threadgroups run one after another; the lanes of a
// threadgroup run as std::threads that meet at a std::barrier for every threadgroup_barrier().
#pragma once
// Included after the kernels: the address-space words are plain C++ again from here on.
#undef device
#undef constant
#undef thread
#undef threadgroup

extern "C" struct EmuArg {
    void* ptr;
    int64_t nbytes;
    int32_t is_scalar;  // 1: a scalar passed by value (bound to a `constant T&` parameter); 0: a buffer
};

namespace emu {

template <class P>
constexpr bool is_buffer_param = std::is_pointer_v<P> || std::is_reference_v<P>;

template <class... P>
struct Layout {
    static constexpr bool buffer[sizeof...(P)] = {is_buffer_param<P>...};
    // Position of parameter i among the buffers (if it is one) or among the attributes (if not).
    static constexpr int index(size_t i) {
        int n = 0;
        for (size_t j = 0; j < i; ++j) n += buffer[j] == buffer[i];
        return n;
    }
    static constexpr int count(bool of_buffers) {
        int n = 0;
        for (bool b : buffer) n += b == of_buffers;
        return n;
    }
};

template <class T, size_t I, class... P>
T bind(EmuArg* args, const uint3* attrs) {
    constexpr int idx = Layout<P...>::index(I);
    if constexpr (std::is_pointer_v<T>) {
        return static_cast<T>(args[idx].ptr);
    } else if constexpr (std::is_reference_v<T>) {
        return *static_cast<std::remove_reference_t<T>*>(args[idx].ptr);
    } else {
        static_assert(std::is_same_v<T, uint3>, "position attributes must be uint3 (see metal_stdlib)");
        return attrs[idx];
    }
}

template <class... P, size_t... I>
void call_lane(void (*fn)(P...), EmuArg* args, const uint3* attrs, std::index_sequence<I...>) {
    fn(bind<P, I, P...>(args, attrs)...);
}

template <class T>
bool check_param(const EmuArg& a, int i, char* err, int errlen) {
    if constexpr (std::is_pointer_v<T>) {
        if (a.is_scalar) {
            snprintf(err, errlen, "argument %d: the kernel expects a buffer (tensor), got a scalar", i);
            return false;
        }
    } else if constexpr (std::is_reference_v<T>) {
        using V = std::remove_cv_t<std::remove_reference_t<T>>;
        if (!a.is_scalar) {
            snprintf(err, errlen, "argument %d: the kernel expects a scalar, got a buffer", i);
            return false;
        }
        if (a.nbytes != (int64_t)sizeof(V)) {
            snprintf(err, errlen, "argument %d: the kernel reads a %zu-byte scalar but %lld bytes were passed",
                     i, sizeof(V), (long long)a.nbytes);
            return false;
        }
    }
    return true;
}

template <class... P, size_t... I>
bool check_params(EmuArg* args, char* err, int errlen, std::index_sequence<I...>) {
    bool ok = true;
    ((ok = ok && (!is_buffer_param<P> || check_param<P>(args[Layout<P...>::index(I)], Layout<P...>::index(I),
                                                           err, errlen))), ...);
    return ok;
}

template <class... P>
int launch(void (*fn)(P...), EmuArg* args, int nargs, const uint32_t* grid, const uint32_t* group, char* err,
           int errlen) {
    constexpr int n_buffers = Layout<P...>::count(true);
    static_assert(Layout<P...>::count(false) <= 3, "at most three position attributes (see metal_stdlib)");
    if (nargs != n_buffers) {
        snprintf(err, errlen, "the kernel takes %d buffer/scalar arguments, got %d", n_buffers, nargs);
        return 1;
    }
    if (!check_params<P...>(args, err, errlen, std::index_sequence_for<P...>{})) return 1;
    const uint32_t lanes = group[0] * group[1] * group[2];
    if (lanes == 0 || lanes > 1024) {
        snprintf(err, errlen, "threadgroup size %u x %u x %u is outside 1..1024 threads", group[0], group[1],
                 group[2]);
        return 1;
    }
    uint32_t groups[3];
    for (int d = 0; d < 3; ++d) {
        if (grid[d] == 0) return 0;
        groups[d] = (grid[d] + group[d] - 1) / group[d];
    }
    // One barrier per possible lane count: full threadgroups and the partial ones at the grid's edges.
    std::map<uint32_t, std::unique_ptr<GroupBarrier>> barriers;
    for (int mask = 0; mask < 8; ++mask) {
        uint32_t n = 1;
        for (int d = 0; d < 3; ++d) {
            uint32_t rem = grid[d] - (groups[d] - 1) * group[d];
            n *= (mask >> d & 1) ? rem : group[d];
        }
        if (!barriers.count(n)) barriers[n] = std::make_unique<GroupBarrier>(n);
    }
    std::barrier<> between_groups(lanes);
    std::vector<std::thread> threads;
    threads.reserve(lanes);
    for (uint32_t l = 0; l < lanes; ++l) {
        threads.emplace_back([&, l] {
            const uint3 lid{l % group[0], (l / group[0]) % group[1], l / (group[0] * group[1])};
            for (uint32_t gz = 0; gz < groups[2]; ++gz)
                for (uint32_t gy = 0; gy < groups[1]; ++gy)
                    for (uint32_t gx = 0; gx < groups[0]; ++gx) {
                        const uint3 size{std::min(group[0], grid[0] - gx * group[0]),
                                         std::min(group[1], grid[1] - gy * group[1]),
                                         std::min(group[2], grid[2] - gz * group[2])};
                        if (lid.x < size.x && lid.y < size.y && lid.z < size.z) {
                            current_barrier = barriers.at(size.x * size.y * size.z).get();
                            const uint3 attrs[3] = {lid, uint3{gx, gy, gz}, size};
                            call_lane(fn, args, attrs, std::index_sequence_for<P...>{});
                            current_barrier->retire();
                        }
                        between_groups.arrive_and_wait();
                    }
        });
    }
    for (auto& t : threads) t.join();
    for (auto& entry : barriers) {
        if (entry.second->diverged()) {
            snprintf(err, errlen, "a threadgroup_barrier was not reached by every thread of a threadgroup (some "
                     "returned first); Metal requires uniform barriers");
            return 1;
        }
    }
    return 0;
}

}  // namespace emu
