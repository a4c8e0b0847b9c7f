# Metal backend on Apple platforms. Meant to be include()d by the top-level CMakeLists.txt inside
# `if(APPLE AND LILY_METAL)`; it defines the static library lily_metal (link it into _lily and define
# LILY_HAVE_METAL=1 there). Not run yet: no Apple machine was available (docs/metal.md).
#
# metal/*.metal -> .air (xcrun metal, IEEE math: -fno-fast-math) -> lily.metallib (xcrun metallib), embedded
# in the extension through an assembler .incbin as lily_metallib / lily_metallib_size (device_mtl.mm).
# metal/gemm_tensor.metal (Metal 4 tensor ops) is built apart with -std=metal4.0 into lily_tensor.metallib
# (lily_tensor_metallib / _size), which the device loads only on MTLGPUFamilyMetal4 hardware, so the main
# library keeps loading on older macOS; with an SDK whose compiler lacks metal4.0 it is embedded empty and
# every machine runs the simdgroup-matrix GEMMs.
enable_language(OBJCXX ASM)

file(GLOB LILY_METAL_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.metal)
set(LILY_METAL_TENSOR_SOURCE ${CMAKE_CURRENT_SOURCE_DIR}/metal/gemm_tensor.metal)
list(REMOVE_ITEM LILY_METAL_SOURCES ${LILY_METAL_TENSOR_SOURCE})
set(LILY_METAL_HEADERS ${CMAKE_CURRENT_SOURCE_DIR}/metal/common.h ${CMAKE_CURRENT_SOURCE_DIR}/metal/gemm_tile.h
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/kernels/params.h)
set(LILY_METAL_AIR "")
foreach(src ${LILY_METAL_SOURCES})
  get_filename_component(stem ${src} NAME_WE)
  set(air ${CMAKE_CURRENT_BINARY_DIR}/metal/${stem}.air)
  add_custom_command(
    OUTPUT ${air}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/metal
    COMMAND xcrun -sdk macosx metal -std=metal3.0 -Wall -Wextra -fno-fast-math
            -I ${CMAKE_CURRENT_SOURCE_DIR}/metal -I ${CMAKE_CURRENT_SOURCE_DIR}/csrc -c ${src} -o ${air}
    DEPENDS ${src} ${LILY_METAL_HEADERS}
    COMMENT "metal ${stem}.metal"
    VERBATIM)
  list(APPEND LILY_METAL_AIR ${air})
endforeach()

set(LILY_METALLIB ${CMAKE_CURRENT_BINARY_DIR}/lily.metallib)
add_custom_command(
  OUTPUT ${LILY_METALLIB}
  COMMAND xcrun -sdk macosx metallib ${LILY_METAL_AIR} -o ${LILY_METALLIB}
  DEPENDS ${LILY_METAL_AIR}
  COMMENT "metallib lily.metallib"
  VERBATIM)

set(LILY_METALLIB_ASM ${CMAKE_CURRENT_BINARY_DIR}/lily_metallib.s)
file(WRITE ${LILY_METALLIB_ASM}
  ".section __DATA,__const\n"
  ".globl _lily_metallib\n.globl _lily_metallib_size\n"
  ".p2align 4\n_lily_metallib:\n.incbin \"${LILY_METALLIB}\"\n_lily_metallib_end:\n"
  ".p2align 3\n_lily_metallib_size:\n.quad _lily_metallib_end - _lily_metallib\n")
set_source_files_properties(${LILY_METALLIB_ASM} PROPERTIES OBJECT_DEPENDS ${LILY_METALLIB})

# Tensor-op library: only if this SDK's compiler accepts -std=metal4.0 (probed once at configure time).
set(LILY_METAL_PROBE ${CMAKE_CURRENT_BINARY_DIR}/metal/probe4.metal)
file(WRITE ${LILY_METAL_PROBE} "#include <metal_stdlib>\nkernel void lily_probe(device float* y [[buffer(0)]]) { y[0] = 0.0f; }\n")
execute_process(COMMAND xcrun -sdk macosx metal -std=metal4.0 -c ${LILY_METAL_PROBE} -o ${LILY_METAL_PROBE}.air
                RESULT_VARIABLE LILY_METAL4_RC OUTPUT_QUIET ERROR_QUIET)
set(LILY_TENSOR_METALLIB_ASM ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor_metallib.s)
if(LILY_METAL4_RC EQUAL 0)
  message(STATUS "lily: Metal 4 compiler found, building the tensor-op GEMMs (lily_tensor.metallib)")
  set(LILY_TENSOR_AIR ${CMAKE_CURRENT_BINARY_DIR}/metal/gemm_tensor.air)
  set(LILY_TENSOR_METALLIB ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor.metallib)
  add_custom_command(
    OUTPUT ${LILY_TENSOR_AIR}
    COMMAND xcrun -sdk macosx metal -std=metal4.0 -Wall -Wextra -fno-fast-math
            -I ${CMAKE_CURRENT_SOURCE_DIR}/metal -I ${CMAKE_CURRENT_SOURCE_DIR}/csrc -c ${LILY_METAL_TENSOR_SOURCE}
            -o ${LILY_TENSOR_AIR}
    DEPENDS ${LILY_METAL_TENSOR_SOURCE} ${LILY_METAL_HEADERS}
    COMMENT "metal gemm_tensor.metal (metal4.0)"
    VERBATIM)
  add_custom_command(
    OUTPUT ${LILY_TENSOR_METALLIB}
    COMMAND xcrun -sdk macosx metallib ${LILY_TENSOR_AIR} -o ${LILY_TENSOR_METALLIB}
    DEPENDS ${LILY_TENSOR_AIR}
    COMMENT "metallib lily_tensor.metallib"
    VERBATIM)
  file(WRITE ${LILY_TENSOR_METALLIB_ASM}
    ".section __DATA,__const\n"
    ".globl _lily_tensor_metallib\n.globl _lily_tensor_metallib_size\n"
    ".p2align 4\n_lily_tensor_metallib:\n.incbin \"${LILY_TENSOR_METALLIB}\"\n_lily_tensor_metallib_end:\n"
    ".p2align 3\n_lily_tensor_metallib_size:\n.quad _lily_tensor_metallib_end - _lily_tensor_metallib\n")
  set_source_files_properties(${LILY_TENSOR_METALLIB_ASM} PROPERTIES OBJECT_DEPENDS ${LILY_TENSOR_METALLIB})
else()
  message(STATUS "lily: no Metal 4 compiler (-std=metal4.0), tensor-op GEMMs not built")
  file(WRITE ${LILY_TENSOR_METALLIB_ASM}
    ".section __DATA,__const\n"
    ".globl _lily_tensor_metallib\n.globl _lily_tensor_metallib_size\n"
    ".p2align 4\n_lily_tensor_metallib:\n.byte 0\n"
    ".p2align 3\n_lily_tensor_metallib_size:\n.quad 0\n")
endif()

add_library(lily_metal STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/device_mtl.mm
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/ops_metal.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/backend_metal.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/backend_options.cpp
  ${LILY_METALLIB_ASM}
  ${LILY_TENSOR_METALLIB_ASM})
target_include_directories(lily_metal PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
target_compile_definitions(lily_metal PRIVATE LILY_METAL_APPLE=1)
target_compile_options(lily_metal PRIVATE $<$<COMPILE_LANGUAGE:OBJCXX>:-fobjc-arc>
                       $<$<COMPILE_LANGUAGE:CXX,OBJCXX>:-Werror=overloaded-virtual>)
target_link_libraries(lily_metal PUBLIC lily_core "-framework Metal" "-framework Foundation")
