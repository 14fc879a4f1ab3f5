// kdelay's request protocol from Node.js with kafkajs: no kdelay library, only records
// with kdelay-* headers on the requests topic.
//
// Usage: node delay-example.js [target-topic] (default "orders"). The broker comes from
// KDELAY_BOOTSTRAP_SERVERS, the topics from KDELAY_REQUESTS_TOPIC and KDELAY_OUTCOMES_TOPIC
// (kdelay's defaults otherwise). It exits 1 when anything arrives early, the cancelled
// record arrives, or an expected record or outcome does not.
'use strict'

const crypto = require('node:crypto')
const { Kafka, Partitioners, logLevel } = require('kafkajs')

const REQUESTS = process.env.KDELAY_REQUESTS_TOPIC || 'kdelay.requests'
const OUTCOMES = process.env.KDELAY_OUTCOMES_TOPIC || 'kdelay.outcomes'
const BROKERS = (process.env.KDELAY_BOOTSTRAP_SERVERS || '127.0.0.1:9092').split(',')
const TIMEOUT_MS = 60_000

// Java's default partitioner (murmur2 of the key), kafkajs's default since 2.0: named here so
// that kafkajs does not warn, and so that keyed records go where kdelay expects them.
const murmur2 = Partitioners.DefaultPartitioner()

async function main () {
  const target = process.argv[2] || 'orders'
  const run = crypto.randomBytes(4).toString('hex') // tells this run's records apart
  const kafka = new Kafka({ clientId: 'kdelay-example', brokers: BROKERS, logLevel: logLevel.ERROR })
  const admin = kafka.admin()
  const producer = kafka.producer({ createPartitioner: Partitioners.DefaultPartitioner })
  await Promise.all([admin.connect(), producer.connect()])
  const requestPartitions = await partitionsOf(admin, REQUESTS)
  const outcomePartitions = await partitionsOf(admin, OUTCOMES)
  // Read the target and the outcomes from their ends as they are now, before anything is written.
  const watch = await watchFromEnd(kafka, admin, [target, OUTCOMES], run)
  const send = async (message) => (await producer.send({ topic: REQUESTS, acks: -1, messages: [message] }))[0]
  const due = Date.now() + 3_000 // an absolute due time just ahead

  try {
    // 1. Three ways to say when: an absolute due time, a delay, a delay level (level 1 = 1 s).
    await send(request(target, run, null, 'by-due', { 'kdelay-due-ms': due }))
    await send(request(target, run, null, 'by-delay', { 'kdelay-delay-ms': 3_000 }))
    await send(request(target, run, null, 'by-level', { 'kdelay-level': 1 }))

    // 2. An id, keyed by a business key: the default partitioner (murmur2 of the key) places it,
    //    maybe off the id's home partition; kdelay forwards it there.
    const orderId = `order-${run}`
    const placed = await send(request(target, run, 'customer-7', 'with-id',
      { 'kdelay-due-ms': due, 'kdelay-id': orderId }))
    const byKey = partitionOf('customer-7', requestPartitions)
    const home = partitionOf(orderId, requestPartitions)
    if (placed.partition !== byKey) fail(`the default partitioner put customer-7 on ${placed.partition}, murmur2 says ${byKey}`)
    console.log(`placed with-id key=customer-7 partition=${placed.partition} id-home=${home} ` +
      `(${placed.partition === home ? 'at home' : 'forwarded by kdelay'})`)
    expect(await watch.outcome(orderId, placed, outcomePartitions), 'scheduled')

    // 3. Schedule and cancel: keyed by the id, both land on the id's home partition
    //    (murmur2 of the id), where Kafka keeps them in the order written.
    const cancelId = `cancel-${run}`
    await send(request(target, run, cancelId, 'cancelled', { 'kdelay-due-ms': due, 'kdelay-id': cancelId }))
    const cancel = await send({ key: cancelId, value: cancelId, headers: { 'kdelay-cancel': cancelId } })
    if (cancel.partition !== partitionOf(cancelId, requestPartitions)) fail("the cancel missed its id's home partition")
    expect(await watch.outcome(cancelId, cancel, outcomePartitions), 'cancelled')

    // 4. Schedule an hour ahead, then reschedule to the due time: no payload sent again.
    const movedId = `moved-${run}`
    await send(request(target, run, movedId, 'rescheduled', { 'kdelay-delay-ms': 3_600_000, 'kdelay-id': movedId }))
    const reschedule = await send({
      key: movedId, value: movedId, headers: { 'kdelay-reschedule': movedId, 'kdelay-due-ms': String(due) }
    })
    expect(await watch.outcome(movedId, reschedule, outcomePartitions), 'rescheduled')

    // 5. What arrives on the target: everything but the cancelled one, none before its due time.
    await watch.arrivals(['by-due', 'by-delay', 'by-level', 'with-id', 'rescheduled'], 'cancelled', due)
  } finally {
    await Promise.all([watch.consumer.disconnect(), producer.disconnect(), admin.disconnect()])
  }
  console.log('ok')
}

// A request for target; `when` holds one of kdelay-due-ms, kdelay-delay-ms, kdelay-level (and maybe kdelay-id).
function request (target, run, key, value, when) {
  const headers = { 'kdelay-target': target, 'example-run': run } // your own headers travel with the record
  for (const [name, time] of Object.entries(when)) headers[name] = String(time)
  return { key, value, headers }
}

// The Java client's default partition for a key: what kdelay calls the id's home partition.
function partitionOf (key, partitionMetadata) {
  return murmur2({ topic: '', partitionMetadata, message: { key } })
}

async function partitionsOf (admin, topic) {
  const { topics } = await admin.fetchTopicMetadata({ topics: [topic] })
  return topics[0].partitions
}

// One consumer on the target and the outcomes topic, each partition from its current end.
async function watchFromEnd (kafka, admin, topics, run) {
  const ends = await Promise.all(topics.map(async (topic) => [topic, await admin.fetchTopicOffsets(topic)]))
  const consumer = kafka.consumer({ groupId: `kdelay-example-${run}` }) // read_committed by default
  const outcomes = new Map() // request coordinates -> outcome
  const arrived = []
  await consumer.connect()
  await consumer.subscribe({ topics })
  await consumer.run({
    eachMessage: async ({ topic, message }) => {
      if (topic === OUTCOMES) {
        const answer = JSON.parse(message.value.toString())
        outcomes.set(answer.request, answer.outcome)
      } else if (String(message.headers['example-run']) === run) { // skip someone else's records
        arrived.push(message)
      }
    }
  })
  for (const [topic, offsets] of ends) {
    for (const { partition, offset } of offsets) consumer.seek({ topic, partition, offset })
  }

  return {
    consumer,

    // Wait for the outcome that answers `request` (the producer's acknowledgement of it).
    async outcome (id, request, outcomePartitions) {
      const coordinates = `${REQUESTS}/${request.partition}/${request.baseOffset}`
      // It is on the id's murmur2 partition of the outcomes topic; this consumer reads them all.
      const partition = partitionOf(id, outcomePartitions)
      await until(() => outcomes.has(coordinates), `no outcome for ${id} on ${OUTCOMES}/${partition}`)
      console.log(`outcome ${id} ${outcomes.get(coordinates)} request=${coordinates}`)
      return outcomes.get(coordinates)
    },

    // Wait for `expected`; fail on an early record or on `cancelled` (until due + 2 s).
    async arrivals (expected, cancelled, due) {
      const seen = new Set()
      await until(() => {
        for (const message of arrived.splice(0)) {
          const value = message.value.toString()
          const dueMs = Number(message.headers['kdelay-due-ms'])
          const at = Number(message.timestamp)
          console.log(`arrived ${value} key=${message.key} due=${dueMs} late_ms=${at - dueMs} ` +
            `origin=${message.headers['kdelay-origin']}`)
          if (value === cancelled) fail('the cancelled record arrived')
          if (at < dueMs) fail(`${value} arrived before its due time`)
          seen.add(value)
        }
        return expected.every((name) => seen.has(name)) && Date.now() > due + 2_000
      }, `arrived ${[...seen]}, expected ${expected}`)
      console.log(`never arrived ${cancelled}`)
    }
  }
}

async function until (condition, failure) {
  const deadline = Date.now() + TIMEOUT_MS
  while (!condition()) {
    if (Date.now() > deadline) fail(failure)
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
}

function expect (outcome, wanted) {
  if (outcome !== wanted) fail(`outcome ${outcome}, expected ${wanted}`)
}

function fail (why) {
  console.log(`FAILED: ${why}`)
  process.exit(1)
}

main().catch((error) => fail(error.stack || error))
