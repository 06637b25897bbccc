// openai-node's Agents API helpers (`client.beta.agents.sessions`), unchanged, against longrun:
// `sessions.create({..., stream: true, toolHandlers})` runs the session's first turn and its tool
// loop (the SDK runs each handler when `turn.item.added` carries the call and posts the result),
// then `sessions.stream(id, {input, toolHandlers})` runs a second turn on the same session.
// The plan arrives as JSON in argv[2]; one JSON report goes to stdout; the Python test
// (tests/test_agents_sdk.py) makes every assertion.
//
// Plan: { baseURL, model, tool, prompt, followUp }
import OpenAI from 'openai';

const plan = JSON.parse(process.argv[2]);
const client = new OpenAI({ apiKey: 'sk-test', baseURL: plan.baseURL, maxRetries: 0 });
const calls = [];
const toolHandlers = {
  [plan.tool.name]: (args) => {
    calls.push(args);
    return `ran: ${String(args.cmd).slice(0, 20)}`;
  },
};

const stream = await client.beta.agents.sessions.create({
  environment: { type: 'none' },
  agent: { model: plan.model, tools: [plan.tool] },
  input: plan.prompt,
  stream: true,
  toolHandlers,
});
const first = await stream.finalResult();
const sessionId = first.turn.session_id;

const events = [];
const second = client.beta.agents.sessions.stream(sessionId, { input: plan.followUp, toolHandlers });
for await (const event of second) {
  events.push(event);
}
const items = [];
for await (const item of client.beta.agents.sessions.items.list(sessionId, { order: 'asc' })) {
  items.push(item);
}
const turns = [];
for await (const turn of client.beta.agents.sessions.turns.list(sessionId, { order: 'asc' })) {
  turns.push(turn);
}
const session = await client.beta.agents.sessions.retrieve(sessionId);
console.log(JSON.stringify({
  calls,
  firstText: first.output_text,
  firstStatus: first.turn.status,
  events,
  items,
  turns,
  session,
}));
