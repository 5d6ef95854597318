/* A stand-in NVTX tool for checking verl's side of the injection protocol on a machine whose
 * Nsight Systems cannot write reports: loaded through NVTX_INJECTION64_PATH exactly as Nsight's
 * libToolsInjection64.so is, it takes the CORE module's RangePushA (slot 9) and RangePop (11)
 * and prints, at exit, how many ranges each name opened.
 * Build: gcc -shared -fPIC -O2 -o nvtx_probe.so nvtx_probe.c -lpthread */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef const void *(*get_export_table_t)(uint32_t id);
typedef struct {
  size_t struct_size;
  int (*get_module_function_table)(uint32_t module, void ***table, unsigned *size);
} callbacks_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static long pushes, pops;
static char names[128][64];
static long counts[128];
static int distinct;

static int probe_push(const char *message) {
  pthread_mutex_lock(&lock);
  pushes++;
  int i = 0;
  while (i < distinct && strcmp(names[i], message) != 0) i++;
  if (i == distinct && distinct < 128) {
    strncpy(names[i], message, 63);
    distinct++;
  }
  if (i < 128) counts[i]++;
  pthread_mutex_unlock(&lock);
  return 0;
}

static int probe_pop(void) {
  pthread_mutex_lock(&lock);
  pops++;
  pthread_mutex_unlock(&lock);
  return 0;
}

static void report(void) {
  fprintf(stderr, "nvtx-probe: %ld ranges opened, %ld closed\n", pushes, pops);
  for (int i = 0; i < distinct; i++) fprintf(stderr, "nvtx-probe: %-28s %ld\n", names[i], counts[i]);
}

int InitializeInjectionNvtx2(get_export_table_t get) {
  const callbacks_t *callbacks = get(1);
  void **table = NULL;
  unsigned size = 0;
  if (!callbacks || callbacks->struct_size < sizeof(callbacks_t)) return 0;
  if (!callbacks->get_module_function_table(1, &table, &size) || size < 12) return 0;
  *(void **)table[9] = (void *)probe_push;
  *(void **)table[11] = (void *)probe_pop;
  atexit(report);
  fprintf(stderr, "nvtx-probe: attached (CORE module, %u slots)\n", size);
  return 1;
}
