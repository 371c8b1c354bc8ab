# Locates ONNX Runtime's C/C++ headers (never committed to this repository).
#
# Order:
#   1. ORTKV_ORT_INCLUDE_DIR (CMake variable or environment variable): a folder you already have
#      that holds onnxruntime_c_api.h.
#   2. The cache: ${ORTKV_CACHE_DIR or $XDG_CACHE_HOME/ortkv or ~/.cache/ortkv}/ort-headers-<ver>.
#   3. A download of the npm registry package com.github.asus4.onnxruntime@<ver> (with `npm pack`,
#      or straight from registry.npmjs.org), of which only the header folder is kept in the cache.
# If none works the configure step stops and says how to provide the headers.

set(ORTKV_ORT_NPM_PACKAGE "com.github.asus4.onnxruntime")
set(ORTKV_ORT_NPM_VERSION "0.4.9")
set(ORTKV_ORT_NPM_SHA1 "3659f34012db8208ffb7f67d704204cb08792fed")
set(_ortkv_hdr_path_in_pkg
    "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers")

function(_ortkv_headers_ok dir out)
  if(dir AND EXISTS "${dir}/onnxruntime_c_api.h")
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

function(ortkv_find_ort_headers out_var)
  set(_explicit "${ORTKV_ORT_INCLUDE_DIR}")
  if(NOT _explicit AND DEFINED ENV{ORTKV_ORT_INCLUDE_DIR})
    set(_explicit "$ENV{ORTKV_ORT_INCLUDE_DIR}")
  endif()
  if(_explicit)
    _ortkv_headers_ok("${_explicit}" _ok)
    if(NOT _ok)
      message(FATAL_ERROR
        "ORTKV_ORT_INCLUDE_DIR='${_explicit}' has no onnxruntime_c_api.h. Point it at the folder "
        "holding ONNX Runtime's headers (API version >= 29), or unset it to download them.")
    endif()
    message(STATUS "ortkv: ONNX Runtime headers from ORTKV_ORT_INCLUDE_DIR=${_explicit}")
    set(${out_var} "${_explicit}" PARENT_SCOPE)
    return()
  endif()

  if(DEFINED ENV{ORTKV_CACHE_DIR})
    set(_cache_root "$ENV{ORTKV_CACHE_DIR}")
  elseif(DEFINED ENV{XDG_CACHE_HOME})
    set(_cache_root "$ENV{XDG_CACHE_HOME}/ortkv")
  else()
    set(_cache_root "$ENV{HOME}/.cache/ortkv")
  endif()
  set(_dest "${_cache_root}/ort-headers-${ORTKV_ORT_NPM_VERSION}")
  _ortkv_headers_ok("${_dest}" _ok)
  if(_ok)
    message(STATUS "ortkv: ONNX Runtime headers from cache ${_dest}")
    set(${out_var} "${_dest}" PARENT_SCOPE)
    return()
  endif()

  set(_work "${CMAKE_BINARY_DIR}/_ort_headers_download")
  file(REMOVE_RECURSE "${_work}")
  file(MAKE_DIRECTORY "${_work}")
  set(_tgz "${_work}/${ORTKV_ORT_NPM_PACKAGE}-${ORTKV_ORT_NPM_VERSION}.tgz")
  set(_why "")
  find_program(ORTKV_NPM npm)
  if(ORTKV_NPM)
    message(STATUS "ortkv: fetching ONNX Runtime headers: npm pack ${ORTKV_ORT_NPM_PACKAGE}@${ORTKV_ORT_NPM_VERSION} (about 150 MB, once)")
    execute_process(
      COMMAND "${ORTKV_NPM}" pack "${ORTKV_ORT_NPM_PACKAGE}@${ORTKV_ORT_NPM_VERSION}" --silent
      WORKING_DIRECTORY "${_work}" RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_VARIABLE _err)
    if(NOT _rc EQUAL 0 OR NOT EXISTS "${_tgz}")
      set(_why "npm pack failed (${_rc}): ${_err}")
    endif()
  else()
    set(_why "npm not found")
  endif()
  if(NOT EXISTS "${_tgz}")
    set(_url "https://registry.npmjs.org/${ORTKV_ORT_NPM_PACKAGE}/-/${ORTKV_ORT_NPM_PACKAGE}-${ORTKV_ORT_NPM_VERSION}.tgz")
    message(STATUS "ortkv: ${_why}; downloading ${_url}")
    file(DOWNLOAD "${_url}" "${_tgz}" STATUS _st EXPECTED_HASH SHA1=${ORTKV_ORT_NPM_SHA1})
    list(GET _st 0 _code)
    if(NOT _code EQUAL 0)
      file(REMOVE "${_tgz}")
      set(_why "${_why}; download failed: ${_st}")
    endif()
  endif()
  if(EXISTS "${_tgz}")
    execute_process(COMMAND tar xzf "${_tgz}" "${_ortkv_hdr_path_in_pkg}"
                    WORKING_DIRECTORY "${_work}" RESULT_VARIABLE _rc ERROR_VARIABLE _err)
    _ortkv_headers_ok("${_work}/${_ortkv_hdr_path_in_pkg}" _ok)
    if(_ok)
      file(MAKE_DIRECTORY "${_cache_root}")
      file(REMOVE_RECURSE "${_dest}")
      file(RENAME "${_work}/${_ortkv_hdr_path_in_pkg}" "${_dest}")
      file(REMOVE_RECURSE "${_work}")
      message(STATUS "ortkv: ONNX Runtime headers cached in ${_dest}")
      set(${out_var} "${_dest}" PARENT_SCOPE)
      return()
    endif()
    set(_why "${_why}; the package has no ${_ortkv_hdr_path_in_pkg} (tar: ${_rc} ${_err})")
  endif()
  message(FATAL_ERROR
    "ortkv needs ONNX Runtime's C headers (onnxruntime_c_api.h, API >= 29) and could not get them: ${_why}.\n"
    "Provide them in one of two ways:\n"
    "  * set ORTKV_ORT_INCLUDE_DIR=/path/to/folder/with/onnxruntime_c_api.h and build again, or\n"
    "  * on a machine with the npm registry: npm pack ${ORTKV_ORT_NPM_PACKAGE}@${ORTKV_ORT_NPM_VERSION}, "
    "extract '${_ortkv_hdr_path_in_pkg}' and copy that folder to ${_dest}.")
endfunction()
