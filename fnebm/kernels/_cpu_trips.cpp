/* A C kernel's trips with a compiled energy, without Python between them.
 *
 * The NUTS kernel of _cpu_nuts.c on a user's energy is a loop of trips: the kernel writes the
 * points its chains need next into `pending`, the energy and its gradient are evaluated there for
 * every chain at once, and `resume` takes them and advances the chains. Driven from Python, a trip
 * cost the kernel's C, the compiled evaluation's arithmetic, and about as much again in Python
 * around them (the loop, ctypes, the generated wrapper's argument lists and the tensors it makes).
 * When the evaluation is an Inductor graph built with the C++ wrapper, fnebm_trips runs the trips
 * here: it calls the graph's entry, inductor_entry_impl(input handles, output handles), takes the
 * two outputs' data to `resume`, frees them, and goes on. Same graph, same kernel, same
 * arguments: the draws are those of the Python loop, bit for bit.
 *
 * The entry's conventions (Inductor's C++ wrapper, checked on the generated source by
 * fnebm/_inductor.py's cpp_entry before an address reaches here): it steals the input handles (so
 * each trip passes fresh handles to the same tensors, aoti_torch_new_tensor_handle of the
 * templates the caller made) and hands over the output handles (deleted here after `resume`); it
 * reports a failure by a C++ exception, caught here (a failure it reports as a Python error, from an
 * operation it calls back into Python for, raises from the ctypes call instead: the caller sees that
 * error); it releases and retakes the GIL, so it is called with the GIL held (ctypes.PYFUNCTYPE), and
 * the kernel's C between two evaluations runs holding it. A call returns after max_ns nanoseconds of
 * trips at most, so that Ctrl-C and other Python threads wait no longer than that. The shim functions are libtorch's C API, their
 * addresses passed in: this library links nothing of torch.
 *
 * Built by fnebm/kernels/cpu_trips.py (fnebm/_cbuild.py, with the C compiler as C++) into a library of
 * its own: where no C++ compiler is found, the Python loop runs the trips as before.
 */
#include <chrono>
#include <cstdint>
#include <exception>
#include <new>

typedef struct AtenTensorOpaque *handle_t;
typedef void (*entry_fn)(handle_t *inputs, handle_t *outputs);
typedef int32_t (*new_handle_fn)(handle_t orig, handle_t *out);
typedef int32_t (*delete_fn)(handle_t h);
typedef int32_t (*data_ptr_fn)(handle_t h, void **out);
typedef int64_t (*resume_fn)(void *ctx, const float *energy, const float *grad, float *pending);

#define MAX_INPUTS 256

typedef struct {
    entry_fn entry;
    new_handle_fn new_handle;
    delete_fn del;
    data_ptr_fn data_ptr;
    int64_t n_inputs;
    handle_t *inputs; /* the graph's inputs (borrowed templates; the positions are `pending`) */
    resume_fn resume;
    void *ctx;
    float *pending;
    int64_t max_ns; /* back to the caller once the trips have taken this long (Ctrl-C, other threads) */
} trips_args_t;

/* Error codes (*error): 0 none; 1 the entry failed (an exception); 2 a shim call failed or an output
 * is missing; 3 too many inputs. On an error the trip is not made: `waiting` is returned as it came
 * in, and the caller makes that trip in Python, where the failure raises with its message. */
extern "C" int64_t fnebm_trips(const trips_args_t *a, int64_t waiting, int64_t max_trips, int64_t *trips,
                               int32_t *error) {
    handle_t in[MAX_INPUTS];
    int64_t count = 0;
    const auto start = std::chrono::steady_clock::now();
    *error = 0;
    if (a->n_inputs > MAX_INPUTS || a->n_inputs < 0) {
        *error = 3;
        *trips = 0;
        return waiting;
    }
    while (waiting > 0 && count < max_trips) {
        for (int64_t i = 0; i < a->n_inputs; i++) {
            if (a->new_handle(a->inputs[i], &in[i]) != 0) {
                for (int64_t j = 0; j < i; j++)
                    a->del(in[j]);
                *error = 2;
                goto out;
            }
        }
        {
            handle_t outs[2] = {nullptr, nullptr};
            try {
                a->entry(in, outs);  /* takes the inputs, even when it throws (they are its RAII handles) */
            } catch (...) {
                if (outs[0])
                    a->del(outs[0]);
                if (outs[1] && outs[1] != outs[0])
                    a->del(outs[1]);
                *error = 1;
                goto out;
            }
            void *e = nullptr, *g = nullptr;
            const bool ok = outs[0] && outs[1] && a->data_ptr(outs[0], &e) == 0 && a->data_ptr(outs[1], &g) == 0;
            if (ok)
                waiting = a->resume(a->ctx, (const float *)e, (const float *)g, a->pending);
            if (outs[0])
                a->del(outs[0]);
            if (outs[1] && outs[1] != outs[0])  /* an output given twice is one handle */
                a->del(outs[1]);
            if (!ok) {
                *error = 2;
                goto out;
            }
        }
        count++;
        if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count()
            >= a->max_ns)
            break;
    }
out:
    *trips = count;
    return waiting;
}

/* For the tests: an entry that fails as a graph's can (an allocation refused), after taking its inputs. */
static delete_fn test_del = nullptr;
extern "C" void fnebm_trips_test_set_delete(delete_fn del) { test_del = del; }
extern "C" void fnebm_trips_test_failing_entry(handle_t *inputs, handle_t *outputs) {
    (void)outputs;
    if (test_del)
        test_del(inputs[0]);
    throw std::bad_alloc();
}
