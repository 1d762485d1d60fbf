/* Atomic accessors for the controller: see region_atomics.h. */
#include "region_atomics.h"

uint64_t vgpu_load_u64(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void vgpu_store_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
uint64_t vgpu_exchange_u64(uint64_t *p, uint64_t v) { return __atomic_exchange_n(p, v, __ATOMIC_ACQ_REL); }
uint64_t vgpu_sub_u64(uint64_t *p, uint64_t v) { return __atomic_sub_fetch(p, v, __ATOMIC_ACQ_REL); }
uint32_t vgpu_load_u32(uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void vgpu_store_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
int32_t vgpu_load_i32(int32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void vgpu_store_i32(int32_t *p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
